"""One replica of an adaptive Tune trial: ``python -m adaptrain.ray._tune_replica PAYLOAD PARENT``.

The trial's replica host (a Ray actor in one bundle of the trial's placement group) starts it
with the ``ADAPTRAIN_*`` variables of its rank, and ``PAYLOAD`` a pickle (cloudpickle) of
``(function, config, backend)``. It joins the trial's process group with
:func:`adaptrain.torch.init_process_group` (which also picks the checkpoint to resume from) and
calls ``function(config)``, as AdaptDL's trainable did. A SIGTERM stops it the adaptrain way:
at the next step boundary every replica checkpoints and exits with 143. It ends with its host
(``PARENT``): it is sent SIGTERM, and SIGKILL 10 s later if still alive (without its host
no checkpoint reaches Tune, and its peers may be gone from the collective it waits in).

Nothing here imports Ray: a replica pays for torch and adaptrain only.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m adaptrain.ray._tune_replica PAYLOAD PARENT_PID", file=sys.stderr)
        return 2
    payload, parent = args[0], int(args[1])
    from adaptrain.procs import die_with_parent

    die_with_parent(parent, kill_after=10.0)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with open(payload, "rb") as f:
        function, config, backend = pickle.load(f)  # noqa: S301 - written by the trial's host
    os.remove(payload)

    import adaptrain.torch as adl

    adl.init_process_group(backend)
    function(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running a :class:`~adaptrain.ray.launcher.RayLauncher` in a thread of the test, against a
``local_ray_cluster``, and always stopping it and what it started."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from _launcher_jobs import kill_leftovers

from adaptrain.ray.launcher import RayLauncher


class LauncherThread:
    """``launcher.run()`` in a daemon thread; :attr:`code` once it returned."""

    def __init__(self, launcher: RayLauncher) -> None:
        self.launcher = launcher
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="launcher", daemon=True)

    def _run(self) -> None:
        try:
            self.code = self.launcher.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float) -> int:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), (
            f"the launcher still runs after {timeout:g} s; events: {self.describe()}"
        )
        if self.error is not None:
            raise AssertionError(f"the launcher raised {self.error!r}") from self.error
        return self.code

    def describe(self) -> str:
        return "\n".join(f"  {kind}: {msg}" for _, kind, msg in self.launcher.events)


@contextlib.contextmanager
def running(launcher: RayLauncher, marker: str) -> Iterator[LauncherThread]:
    """Start ``launcher`` in a thread; on exit stop it (the replicas checkpoint first), and
    kill any process whose command line names ``marker`` (the test's folder) that survived
    (a test that ended well checks there is none)."""
    runner = LauncherThread(launcher)
    runner.thread.start()
    try:
        yield runner
    finally:
        launcher.stop()
        runner.thread.join(90)
        kill_leftovers(marker)


def script_args(tmp_path, *args: str) -> list[str]:
    return [*args, "--tag", str(tmp_path)]


def log_env(tmp_path) -> dict[str, str]:
    return {"LAUNCHER_TEST_LOG": os.path.join(str(tmp_path), "events.jsonl")}

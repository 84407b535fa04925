"""The state database's job queries: by phase, by target, oldest first."""

from __future__ import annotations

from adaptrain.service.store import JobRecord, Store


def test_jobs_filter_by_phase_and_by_a_target_oldest_first(tmp_path):
    store = Store(str(tmp_path / "state.db"))
    try:
        for i, (phase, target) in enumerate([
            ("Pending", None), ("Pending", ["n0", "n0"]), ("Running", None),
            ("Pending", ["n1"]), ("Stopping", ["n1"]), ("Pending", []),
        ]):  # fmt: skip
            store.add_job(JobRecord(name=f"j{i}", spec={"command": ["x"]}, token="t",
                                    phase=phase, submitted=100.0 - i))  # fmt: skip
            store.update_job(f"j{i}", target=target)
        names = lambda jobs: [j.name for j in jobs]  # noqa: E731
        assert names(store.jobs()) == ["j5", "j4", "j3", "j2", "j1", "j0"]
        assert names(store.jobs(("Pending",))) == ["j5", "j3", "j1", "j0"]
        assert names(store.jobs(("Pending",), targeted=True)) == ["j3", "j1"]
        assert names(store.jobs(targeted=True)) == ["j4", "j3", "j1"]
        assert store.jobs(("Pending",), targeted=True)[1].target == ["n0", "n0"]
    finally:
        store.close()

"""kvxfer's NIXL stand-in against the real NIXL (1.5.1, UCX, DRAM): one
scripted session (`nixl_sequence.py`: configuration, plugin queries,
descriptor validation, registration, peers, checks made when a request is
made, transfers and their states, telemetry with and without merging and
as switched by the environment, notifications) is run unmodified, with
`import nixl` resolving once to each; every step's result or exception
class must match."""

from conftest import run_script, shim_env

# What the session must show on kvxfer whatever the real NIXL does: the
# comparison alone would pass if both broke alike.
MUST = {
    "final state": ["ok", "DONE"],
    "landed": ["ok", True],
    "telemetry counts": ["ok", [4096, 2]],
    "prepped descCount skip=False": ["ok", 3],
    "prepped descCount skip=True": ["ok", 5],
    "notifs": ["ok", {"seq-a": ["seq-1", "seq-1", "seq-2"]}],
    "create unknown": ["raise", "nixlNotFoundError"],
    "init local unregistered": ["raise", "nixlNotFoundError"],
    "env off": ["raise", "nixlNoTelemetryError"],
    "env on": ["ok", 64],
}


def test_kvxfer_session_shows_what_nixl_promises():
    ours = dict(run_script("nixl_sequence.py", shim_env("nixl")))
    for step, want in MUST.items():
        assert ours[step] == want, f"{step}: {ours[step]} (want {want})"


def test_same_results_as_the_real_nixl(real_nixl_env):
    real = run_script("nixl_sequence.py", real_nixl_env)
    ours = run_script("nixl_sequence.py", shim_env("nixl"))
    assert [s for s, _ in ours] == [s for s, _ in real]
    diff = [(s, o, r) for (s, o), (_, r) in zip(ours, real) if o != r]
    assert not diff, "\n".join(f"{s}: kvxfer {o} vs nixl {r}" for s, o, r in diff)

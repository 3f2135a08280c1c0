"""netcluster (tests' side): scripts/netcluster.py for integration tests, and the skip rule.

scripts/netcluster.py is loaded under the name netcluster_core (this module is `netcluster` on
the tests' path, so the script cannot be imported by that name here). require() skips the
calling test with the reason where network namespaces cannot be made (not root, no iproute2,
a kernel or container that refuses `ip netns add`): such a test never passes silently.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PATH = os.path.join(REPO, "scripts", "netcluster.py")

_spec = importlib.util.spec_from_file_location("netcluster_core", _PATH)
core = importlib.util.module_from_spec(_spec)
sys.modules["netcluster_core"] = core
_spec.loader.exec_module(core)

Cluster = core.Cluster
NetclusterError = core.NetclusterError
start_meshrun = core.start_meshrun
wait_all = core.wait_all
list_netns = core.list_netns
read_metrics = core.read_metrics

_verdict = None


def require():
    """pytest.skip (naming the reason) where namespaces cannot be made; probed once per run."""
    global _verdict
    if _verdict is None:
        _verdict = core.can_create()
    ok, why = _verdict
    if not ok:
        pytest.skip("emulated cluster network unavailable: %s" % why)


def run_nodes(cluster, args, timeout, **kwargs):
    """start_meshrun(cluster, args, **kwargs) with the output captured, waited for up to timeout
    seconds (a node still running then is killed); returns (exit codes, outputs) per node."""
    procs = start_meshrun(cluster, args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    codes = wait_all(procs, timeout)
    outs = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        outs.append(p.communicate()[0].decode(errors="replace"))
    return codes, outs

"""netcluster_pytest: the emulated cluster network (test/support/netcluster.py) for integration
tests, and the skip rule.

The library is the module `netcluster` in test/support, imported by that name from there by the
tests (through this module) and by the benchmarks alike. require() skips the calling test with the
reason where network namespaces cannot be made (not root, no iproute2, a kernel or container that
refuses `ip netns add`): such a test never passes silently.
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "test", "support"))
import netcluster as core  # noqa: E402

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

"""The allocator settings of the proxy process (proxyvisor.proxy.allocator): big request blocks reuse the heap's
pages; while big texts are built, big blocks are mapped of their own. Checked by what they are for, the page faults
of allocating and freeing a 4 MB block again and again, in a fresh process (the settings must precede threads)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's (mallopt)")

_SCRIPT = """
import resource
from proxyvisor.proxy import allocator

pieces = [bytes([n]) * (255 * 1024) for n in range(16)]  # a 4 MB body as the reads bring it

def faults_per_join():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        body = b"".join(pieces)
        del body
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

allocator.tune()
faults_per_join()  # the heap grows once
print(faults_per_join())
with allocator.big_blocks_mapped():
    with allocator.big_blocks_mapped():
        print(faults_per_join())
    print(faults_per_join())  # one work still wants them mapped
faults_per_join()  # the heap grows again once
print(faults_per_join())
"""


def test_big_request_blocks_reuse_pages_and_are_mapped_only_while_big_texts_are_built() -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    heap, nested, outer, after = (float(line) for line in run.stdout.split())
    pages = 4 * 1024 * 1024 // 4096
    assert heap < pages / 10, f"a 4 MB block faulted {heap} pages in per allocation by default"
    assert nested > pages * 0.9 and outer > pages * 0.9, "big blocks were not mapped while big texts are built"
    assert after < pages / 10, "the default did not come back once no work wants big blocks mapped"

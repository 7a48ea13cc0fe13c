from stree.tools import selfcheck


def test_selfcheck_passes_and_prints_every_kernel_and_backend(capsys):
    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    for kernel in ("tree_scan", "tree_conv1d", "multistep_update", "replay", "tree_attention"):
        for backend in ("torch", "triton"):
            assert any(line.split()[:1] == [kernel] and backend in line.split() for line in out.splitlines()), (kernel, backend)
    assert "all kernels match their definitions" in out
    assert " NO" not in out

"""The README's main job, ``python -m fp4fuse.demo``, runs and fuses on a TP=2 gloo group."""
from fp4fuse import demo


def test_demo_runs_fuses_and_matches_eager(capsys):
    assert demo.main(["--layers", "1", "--hidden", "64", "--tokens-per-rank", "40", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "async_tp.all_gather_mm_fp4" in out
    assert "bitwise equal: True" in out

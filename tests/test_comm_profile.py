"""tools/comm_profile.py at a 4-process layout (tp=2, pp=2, ep=2 on gloo): a line for every
group of the layout x each operation megamoe issues on it x each size, with ordered
percentiles and a positive bandwidth; sizes parse or fail in one line."""
from __future__ import annotations

import pytest


def run_profile(argv: list[str]) -> str:
    import contextlib
    import io

    from megamoe.commands.comm_profile import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    return out.getvalue()


def test_profile_covers_every_group_of_a_4_process_layout(pool):
    from megamoe.diagnostics.comm_profile import GROUP_OPS

    outputs = pool(4).run(run_profile, ["--tp", "2", "--pp", "2", "--ep", "2", "--sizes", "4KiB,64KiB",
                                        "--iters", "5", "--warmup", "1"])
    assert all(o == "" for o in outputs[1:])  # the first rank prints
    lines = outputs[0].strip().splitlines()
    assert lines[0].startswith("layout: world 4 tp=2 pp=2 ep=2 etp=1 dp=1 (gloo)")
    rows = [line.split() for line in lines[2:]]
    # at this layout rank 0 has tp, pp, ep and tp_ep groups of two (dp, etp, edp are single ranks)
    want = [(g, op, size) for g in ("tp", "pp", "ep", "tp_ep") for op in GROUP_OPS[g] for size in ("4KiB", "64KiB")]
    assert [(r[0], r[1], r[3]) for r in rows] == want
    for r in rows:
        p50, p90, p99, bw = map(float, r[4:8])
        assert r[2] == "2" and 0 < p50 <= p90 <= p99 and bw > 0


def test_sizes_parse_and_bad_sizes_are_one_line():
    from megamoe.diagnostics.comm_profile import parse_sizes
    from megamoe.core.errors import ConfigError

    assert parse_sizes("4KiB, 1MiB,16M,512") == [4096, 1 << 20, 16 << 20, 512]
    with pytest.raises(ConfigError, match="'4XB' is not a size"):
        parse_sizes("4XB")
    with pytest.raises(ConfigError, match="below one fp32 element"):
        parse_sizes("2B")

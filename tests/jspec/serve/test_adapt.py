"""The load adapter's choice among the whole tree, a short chain and plain steps (``jspec.serve.adapt``)."""

from __future__ import annotations

import pytest

from jspec.serve.adapt import FULL, PLAIN, SHORT, CostTable, LoadAdapter


def short_costs() -> CostTable:
    # per step: whole chain (10 nodes) 90 ms, short chain (3 nodes) 45 ms, plain 36 ms at 32 rows; at 1 row the
    # short program was not compiled
    return CostTable({1: 0.004, 32: 0.090}, {1: 0.003, 32: 0.036}, short_step_seconds={32: 0.045})


def test_the_short_chain_wins_where_the_whole_one_costs_more_than_it_saves():
    # committed per whole-chain step: 1 (half the steps), 2 (a quarter), 6 (a quarter): mean 2.5; cut after 2
    # drafts each commits min(n, 3): 1, 2, 3 -> mean 1.75, a ratio of 0.7
    adapter = LoadAdapter(short_costs(), acceptance=2.5, short_draft_len=2,
                          accepted_hist=[2, 1, 0, 0, 0, 1, 0, 0, 0, 0])
    assert adapter.short_ratio() == pytest.approx(0.7)
    # 32 rows: whole 2.5 / 0.090 = 27.8, short 1.75 / 0.045 = 38.9, plain 1 / 0.036 = 27.8 tokens/s per row
    assert adapter.choose_program(32) == SHORT
    assert adapter.choose_program(1) == FULL  # no short program at 1 row: 2.5 / 0.004 > 1 / 0.003
    # rows that accept little: the short chain no longer pays either
    assert adapter.choose_program(32, acceptance=1.2) == PLAIN


def test_a_short_chunk_counts_as_the_whole_chain_would_and_only_whole_steps_move_the_ratio():
    adapter = LoadAdapter(short_costs(), acceptance=2.5, smoothing=1.0, short_draft_len=2,
                          accepted_hist=[2, 1, 0, 0, 0, 1, 0, 0, 0, 0])
    adapter.observe(SHORT, tokens=14, steps=10)  # 1.4 per short step = 2.0 per whole step at the ratio 0.7
    assert adapter.acceptance == pytest.approx(2.0)
    adapter.observe_accepted([0, 0, 4, 0, 0, 0, 0, 0, 0, 0], weight=1.0)  # every whole step committed 3
    assert adapter.short_ratio() == pytest.approx(1.0)  # a chain cut after 2 drafts commits those 3 too
    # without a distribution: as if every step committed the running acceptance
    assert LoadAdapter(short_costs(), acceptance=4.0, short_draft_len=2).short_ratio() == pytest.approx(0.75)


def test_the_short_program_is_timed_at_each_context_and_probed():
    adapter = LoadAdapter(short_costs(), acceptance=2.5, short_draft_len=2, probe_every=3,
                          accepted_hist=[2, 1, 0, 0, 0, 1, 0, 0, 0, 0])
    seconds = {SHORT: 0.045, FULL: 0.090, PLAIN: 0.036}
    runs = []
    for _ in range(9):
        runs.append(adapter.choose_program(32, seq_len=512))
        adapter.observe(runs[-1], tokens=0, steps=0, rows=32, seconds=4 * seconds[runs[-1]], loop_steps=4,
                        seq_len=512)
    assert set(runs[:2]) == {FULL, PLAIN}  # the others, never timed at this context, first
    assert runs[2:4] == [SHORT, SHORT] and runs[4] != SHORT  # then the best, and a probe in every three
    assert runs.count(SHORT) >= 5


def test_a_short_program_needs_its_length_and_a_table():
    with pytest.raises(ValueError, match="short_draft_len"):
        LoadAdapter(short_costs(), acceptance=2.0)
    with pytest.raises(ValueError, match="short_draft_len"):
        LoadAdapter(CostTable({1: 0.01}, {1: 0.01}), acceptance=2.0, short_draft_len=2)
    with pytest.raises(ValueError, match="program='medium'"):
        short_costs().seconds("medium")


def test_the_adapter_picks_the_faster_program_and_probes():
    # one row: a verify pass costs little more than a plain step (memory-bound); eight: three times as much
    costs = CostTable({1: 0.012, 8: 0.03}, {1: 0.01, 8: 0.01})
    adapter = LoadAdapter(costs, acceptance=2.5, probe_every=4)
    assert adapter.choose(1) and not adapter.choose(8)  # 2.5 / 0.012 > 1 / 0.01 > 2.5 / 0.03
    adapter = LoadAdapter(costs, acceptance=4.0, probe_every=4)
    assert adapter.choose(8)  # 4 / 0.03 > 1 / 0.01
    while adapter.acceptance > 2.5:  # acceptance falls to 1: speculation no longer pays at 8 rows
        adapter.observe(True, tokens=10, steps=10)
    choices = [adapter.choose(8) for _ in range(8)]
    assert choices == [False, False, False, True] * 2  # plain, with a speculative probe every 4th chunk


def test_the_adapter_probes_plain_steps_while_it_speculates_and_keeps_costs_by_sampling():
    # speculation wins by 20% on the table: every 4th chunk a plain probe corrects the plain cost; chunks with a
    # sampled row have their own table, where plain wins
    costs = CostTable({8: 0.02}, {8: 0.01}, sampled_spec_step_seconds={8: 0.05}, sampled_plain_step_seconds={8: 0.01})
    adapter = LoadAdapter(costs, acceptance=2.4, probe_every=4)
    assert [adapter.choose(8) for _ in range(8)] == [True, True, True, False] * 2
    adapter.observe(False, tokens=8, steps=8, rows=8, seconds=0.004, loop_steps=4, sampled=True)
    assert costs.plain_step_seconds[8] == 0.01 and costs.sampled_plain_step_seconds[8] < 0.01
    assert not adapter.choose(8, sampled=True)


def test_the_adapter_times_each_context_and_probes_an_untimed_one_at_once():
    # the start-up table (the longest context) has speculation winning at 8 rows; at a shorter context a plain
    # step costs a third of the table's
    adapter = LoadAdapter(CostTable({8: 0.02}, {8: 0.015}), acceptance=2.0, probe_every=8)
    assert adapter.choose(8)  # by the table: 2 / 0.02 > 1 / 0.015
    assert not adapter.choose(8, seq_len=256)  # plain steps never timed at this context: a probe at once
    adapter.observe(False, tokens=8, steps=8, rows=8, seconds=0.02, loop_steps=4, seq_len=256)
    assert adapter.step_seconds(False, 8, seq_len=256) == 0.005  # the first timing replaces the table's
    assert adapter.step_seconds(False, 8) == pytest.approx(0.012)  # which moves too (smoothing 0.3)
    assert adapter.choose(8, seq_len=256)  # speculation not timed here either: once, whatever the table says
    adapter.observe(True, tokens=16, steps=8, rows=8, seconds=0.06, loop_steps=4, seq_len=256)
    assert [adapter.choose(8, seq_len=256) for _ in range(3)] == [False] * 3  # 1 / 0.005 > 2 / 0.015
    assert adapter.choose(8, seq_len=1024) is False  # untimed there too: plain probed first, by the moved table


def test_the_adapter_never_probes_where_speculation_cannot_pay():
    costs = CostTable({1: 0.012, 8: 0.03}, {1: 0.01, 8: 0.01})
    adapter = LoadAdapter(costs, acceptance=2.5, probe_every=2, max_acceptance=2.9)
    assert [adapter.choose(8) for _ in range(6)] == [False] * 6  # 2.9 / 0.03 < 1 / 0.01: no probe either
    assert adapter.choose(1)


def test_the_adapter_measures_a_fresh_request_where_the_estimate_alone_would_keep_it_plain():
    # one row: speculation pays above 2 tokens per verify step; the estimate over all says 1.25
    costs = CostTable({1: 0.004, 32: 0.04}, {1: 0.002, 32: 0.01})
    adapter = LoadAdapter(costs, acceptance=1.25, explore=1.0)
    fresh = adapter.expected_acceptance([(None, 0)])
    assert fresh == pytest.approx(2.25) and adapter.choose(1, fresh)  # never measured: worth a chunk
    assert not LoadAdapter(costs, acceptance=1.25, explore=0.0).choose(1, 1.25)  # without the bonus: plain for good
    # measured at 1.1 over 12 verify steps: the bonus is down to 1 / sqrt(13) and plain wins
    assert not adapter.choose(1, adapter.expected_acceptance([(1.1, 12)]))
    assert adapter.choose(1, adapter.expected_acceptance([(3.0, 12)]))  # one that accepts well stays speculative
    # at 32 rows speculation pays above 1.75 (a verify pass costs 1.75 plain steps): 32 fresh requests bound their
    # mean at 1.25 + 1 / sqrt(32), not 1.25 + 1, so no speculative chunk; nor one fresh among 31 measured at 1.0
    costs.spec_step_seconds[32], costs.plain_step_seconds[32] = 0.035, 0.02
    fresh_crowd = adapter.expected_acceptance([(None, 0)] * 32)
    assert fresh_crowd == pytest.approx(1.25 + 32 ** -0.5) and not adapter.choose(32, fresh_crowd)
    crowd = adapter.expected_acceptance([(1.0, 40)] * 31 + [(None, 0)])
    assert crowd < 1.25 and not adapter.choose(32, crowd)
    with pytest.raises(ValueError, match="explore=-1"):
        LoadAdapter(costs, acceptance=1.25, explore=-1)


def test_an_untimed_program_is_probed_only_where_its_estimate_could_pay():
    # 32 rows: by the table a verify pass of the whole chain costs six plain steps
    adapter = LoadAdapter(CostTable({32: 0.06}, {32: 0.01}), acceptance=2.0, probe_every=100)
    assert adapter.choose_program(32, seq_len=256) == PLAIN
    adapter.observe(PLAIN, tokens=0, steps=0, rows=32, seconds=0.02, loop_steps=4, seq_len=256)
    # plain steps here cost 0.005 s, 0.59 of the table's moved 0.0085: the whole chain's estimate falls as much
    assert adapter.step_seconds(FULL, 32, seq_len=256) == pytest.approx(0.06 * 0.005 / 0.0085)
    # 2 tokens per verify step over 0.0353 s: 57 tokens/s, short of plain's 200 even at 1.5 times: never timed here
    assert [adapter.choose_program(32, seq_len=256) for _ in range(5)] == [PLAIN] * 5
    # rows that accept 5 per step could pay (142 tokens/s, 212 at 1.5 times): timed here at once
    assert adapter.choose_program(32, acceptance=5.0, seq_len=256) == FULL

"""The packing and mask builders, checked exactly against small hand-written matrices."""

import numpy as np
import pytest

from onepass.runtime.core.tree import QuestionTokens, ancestor_mask, option_logprobs, pack
from onepass.runtime.backends.batch import causal


def test_two_questions_with_shared_option_prefix():
    q1 = QuestionTokens(trunk=(5, 6), options=((7, 8), (7, 9)))  # options share their first token
    q2 = QuestionTokens(trunk=(13,), options=((4,), (2,)))
    batch = pack([q1, q2], past_len=10)
    # packed: 5 6 | 7 (shared, has children) | 13 ; leaves 8, 9, 2, 4 are targets only
    np.testing.assert_array_equal(batch.input_ids, [5, 6, 7, 13])
    np.testing.assert_array_equal(batch.position_ids, [10, 11, 12, 10])
    np.testing.assert_array_equal(batch.tree_mask, np.array([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 0, 0, 1],
    ], dtype=bool))
    np.testing.assert_array_equal(batch.readout_index, [1, 2, 2, 3, 3])
    np.testing.assert_array_equal(batch.readout_target, [7, 8, 9, 2, 4])  # options in sorted order
    assert [[r.tolist() for r in q] for q in batch.option_readouts] == [[[0, 1], [0, 2]], [[4], [3]]]


def test_packing_does_not_depend_on_the_order_given():
    q1 = QuestionTokens(trunk=(5, 6), options=((7, 8), (7, 9), (3,)))
    q2 = QuestionTokens(trunk=(5, 4), options=((4,), (2,)))
    a = pack([q1, q2], past_len=3)
    b = pack([q2, QuestionTokens(q1.trunk, (q1.options[2], q1.options[0], q1.options[1]))], past_len=3)
    for name in ("input_ids", "position_ids", "tree_mask", "readout_index", "readout_target"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert [r.tolist() for r in a.option_readouts[0]] == [r.tolist() for r in
                                                          (b.option_readouts[1][i] for i in (1, 2, 0))]


def test_branches_do_not_see_each_other():
    q = QuestionTokens(trunk=(1,), options=((2, 3, 4), (5, 6, 7)))
    batch = pack([q], past_len=0)
    np.testing.assert_array_equal(batch.input_ids, [1, 2, 3, 5, 6])
    np.testing.assert_array_equal(batch.position_ids, [0, 1, 2, 1, 2])
    np.testing.assert_array_equal(batch.tree_mask, np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ], dtype=bool))
    np.testing.assert_array_equal(batch.readout_index, [0, 1, 2, 0, 3, 4])
    np.testing.assert_array_equal(batch.readout_target, [2, 3, 4, 5, 6, 7])


def test_option_logprobs_follow_the_chain_rule():
    q = QuestionTokens(trunk=(1,), options=((2, 3), (2, 4), (5,)))
    batch = pack([q], past_len=4)
    lp = np.array([-0.5, -1.0, -2.0, -3.0], dtype=np.float32)  # nodes: 2, 3, 4, 5
    np.testing.assert_allclose(option_logprobs(batch, lp)[0], [-1.5, -2.5, -3.0])


def test_ancestor_mask_and_causal():
    np.testing.assert_array_equal(ancestor_mask([-1, 0, 0, 2]), np.array([
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool))
    c = causal([9, 8, 7], start=5)
    np.testing.assert_array_equal(c.tree_mask, np.tril(np.ones((3, 3), dtype=bool)))
    np.testing.assert_array_equal(c.position_ids, [5, 6, 7])
    with pytest.raises(ValueError, match="parents must come first"):
        ancestor_mask([-1, 2, 0])


def test_question_tokens_validation():
    with pytest.raises(ValueError, match="trunk"):
        QuestionTokens(trunk=(), options=((1,),))
    with pytest.raises(ValueError, match="same tokens"):
        QuestionTokens(trunk=(1,), options=((2,), (2,)))


def test_trunks_sharing_a_prefix_share_tokens_but_not_their_options():
    q1 = QuestionTokens(trunk=(1, 2, 3), options=((7,), (8,)))
    q2 = QuestionTokens(trunk=(1, 2, 4), options=((7,), (9, 9)))
    batch = pack([q1, q2], past_len=5)
    # shared 1 2, then 3 (q1) and 4 (q2); q2's option "9 9" packs its first 9
    np.testing.assert_array_equal(batch.input_ids, [1, 2, 3, 4, 9])
    np.testing.assert_array_equal(batch.position_ids, [5, 6, 7, 7, 8])
    np.testing.assert_array_equal(batch.tree_mask, np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=bool))
    np.testing.assert_array_equal(batch.readout_index, [2, 2, 3, 3, 4])
    np.testing.assert_array_equal(batch.readout_target, [7, 8, 7, 9, 9])
    assert [[r.tolist() for r in q] for q in batch.option_readouts] == [[[0], [1]], [[2], [3, 4]]]


def test_identical_questions_share_everything():
    q = QuestionTokens(trunk=(1, 2), options=((3,), (4,)))
    batch = pack([q, q], past_len=0)
    np.testing.assert_array_equal(batch.input_ids, [1, 2])
    assert [r.tolist() for r in batch.option_readouts[0]] == [r.tolist() for r in batch.option_readouts[1]]


def test_the_tree_in_2n_numbers_is_exactly_its_ancestor_mask():
    """``intervals`` (what the GPU pass uploads instead of the [N, N] mask): on random forests, on packed batches
    whose trunks run into other questions' options (not packed in preorder), after padding and for a causal chunk,
    the interval formula gives exactly the ancestor mask; a batch carrying only its mask gets the same numbers."""
    from onepass.runtime.backends.batch import interval_mask, intervals, intervals_of_mask, pad_batch

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        order = intervals(parent)
        np.testing.assert_array_equal(interval_mask(order), ancestor_mask(parent))
        np.testing.assert_array_equal(intervals_of_mask(ancestor_mask(parent)), order)
    qs = [QuestionTokens((1, 2, 3), ((4,), (5, 6))), QuestionTokens((1, 2), ((3, 7), (9,))),
          QuestionTokens((1, 2, 3, 4, 5), ((7,), (8,)))]  # a trunk that continues another question's option
    batch = pack(qs, past_len=10)
    for b in (batch, pad_batch(batch, 16, 8), causal([5, 6, 7], 4)):
        np.testing.assert_array_equal(interval_mask(b.tree_order), b.tree_mask)


def test_negative_control_a_mask_that_is_no_tree_or_a_wrong_order_is_caught():
    from onepass.runtime.backends.batch import interval_mask, intervals, intervals_of_mask

    parent = [-1, 0, 1, 0, 3]
    order = intervals(parent)
    shifted = order.copy()
    shifted[:, 1] = order[:, 1].max()  # every subtree runs to the end: questions would see each other
    assert not np.array_equal(interval_mask(shifted), ancestor_mask(parent))
    crossed = ancestor_mask(parent)
    crossed[4, 2] = True  # token 4 sees a token of another branch: no forest's ancestor mask
    with pytest.raises(ValueError, match="not a forest's ancestor mask"):
        intervals_of_mask(crossed)


def test_buckets_pad_by_at_most_a_quarter_in_steps_of_8():
    """Tight buckets (the GPU graphs' shapes): from 32 tokens on, a pass or state pads by at most 1.25x (powers of two
    padded up to 2x: 513 -> 1,024); every bucket is a multiple of 8, monotonic, and a cap ends the ladder."""
    from onepass.runtime.backends.batch import bucket

    sizes = [bucket(n) for n in range(1, 9000)]
    assert all(b >= n and b % 8 == 0 for n, b in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert max(bucket(n) / n for n in range(32, 9000)) <= 1.25
    assert (bucket(421), bucket(513), bucket(2243), bucket(100)) == (448, 640, 2560, 112)
    assert bucket(1100, cap=1500) == 1280 and bucket(1400, cap=1500) == 1500 and bucket(1600, cap=1500) == 1792
    assert len({bucket(n) for n in range(1, 8193)}) <= 40  # few shapes: the graphs a service captures stay few


def test_concat_sets_passes_side_by_side_each_on_its_own_tree():
    """Two packed passes joined (``batch.concat``): the mask is block-diagonal (no token of one sees the other), the
    tree in 2N numbers still gives that mask, read-outs and option paths point at the same tokens as before, and a
    pass without tasks gets task -1 beside one with. Control: the preorder numbers left unmoved overlap the first
    forest's, and their mask differs."""
    from onepass.runtime.backends.batch import concat, interval_mask

    one = pack([QuestionTokens((1, 2, 3), ((7,), (8, 9)))], 5)
    two = pack([QuestionTokens((4, 5), ((7,), (6,)))], 5, tasks=[0])
    joined = concat([one, two])
    n1, n2, r1 = one.num_tokens, two.num_tokens, one.readout_index.shape[0]
    want = np.zeros((n1 + n2, n1 + n2), dtype=bool)
    want[:n1, :n1], want[n1:, n1:] = one.tree_mask, two.tree_mask
    np.testing.assert_array_equal(joined.tree_mask, want)
    np.testing.assert_array_equal(interval_mask(joined.tree_order), want)
    np.testing.assert_array_equal(joined.readout_index, np.concatenate([one.readout_index, two.readout_index + n1]))
    np.testing.assert_array_equal(joined.input_ids[joined.readout_index],
                                  np.concatenate([one.input_ids[one.readout_index], two.input_ids[two.readout_index]]))
    assert [list(r) for q in joined.option_readouts for r in q] == (
        [list(r) for q in one.option_readouts for r in q] + [list(r + r1) for q in two.option_readouts for r in q])
    np.testing.assert_array_equal(joined.token_task, [-1] * n1 + [0] * n2)
    unmoved = np.concatenate([one.tree_order, two.tree_order])
    assert not np.array_equal(interval_mask(unmoved), want)


def test_segment_softmax_equals_each_questions_own_softmax():
    """All questions' options soft-maxed at once equal each question's softmax of its own slice; control: cutting
    the slices one option off does not."""
    from onepass.runtime.core.readout import segment_softmax, softmax

    rng = np.random.default_rng(0)
    counts = np.array([2, 5, 3, 10, 2])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    scores = rng.normal(size=counts.sum()) * 30
    got = segment_softmax(scores, starts, counts)
    for a, k in zip(starts, counts):
        np.testing.assert_allclose(got[a:a + k], softmax(scores[a:a + k]), rtol=0, atol=1e-15)
    cut = segment_softmax(scores, starts + np.array([0, 1, 1, 1, 1]), np.array([3, 5, 3, 10, 1]))
    assert np.abs(cut - got).max() > 1e-3

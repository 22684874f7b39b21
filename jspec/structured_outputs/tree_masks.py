"""The host's half of a structured step: token bitmasks for every node of a draft tree from that node's grammar
state, and the grammar advanced by the tokens a step committed.

Node n's logits choose the token after n, so its mask is the grammar's state after the committed tokens and then
the drafts on the path from the root to n (n included; the root is the last committed token). A node whose path
the grammar rejects can never be accepted (its parent's mask excludes it): its mask allows everything, so its
logits stay finite."""

from __future__ import annotations

import numpy as np

from jspec.structured_outputs.bitmask import bitmask_words


def root_bitmask(matchers: list, vocab_size: int, nodes: int = 1) -> np.ndarray:
    """i32[B, nodes, W]: row b's node 0 the mask of matchers[b]'s current state (None: no grammar, all allowed);
    the other nodes all allowed."""
    out = np.full((len(matchers), nodes, bitmask_words(vocab_size)), -1, np.int32)
    for b, matcher in enumerate(matchers):
        if matcher is not None:
            _fill(matcher, out[b], 0)
    return out


def constrain_tree(matchers: list, tokens: np.ndarray, mask: np.ndarray, vocab_size: int,
                   substitute: bool = True, nodes: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (bitmask i32[B, T, W] each row's node masks, tokens i32[B, T], substituted bool[B]) for a draft tree's
    tokens i32[B, T] (node 0 the root) with ancestry mask bool[B, T, T] (node j is n or an ancestor of n); rows
    without a matcher all allowed.

    substitute: a draft the grammar forbids at its parent is replaced by the token the grammar forces there
    (llguidance's fast-forward tokens: a JSON key, a closing quote), where it forces one; substituted[b] says a
    row's tree changed. Only for deterministic drafts (no draft_probs) or an all-greedy batch (whose verification
    reads no draft_probs): verification of such drafts is lossless whatever chose them, while a sampled draft must
    be the draw its probabilities describe.

    nodes: only the first ``nodes`` (a short chain's, which is all a short step verifies) are masked and may be
    substituted; the rest stay all allowed and unread (default: every node).

    Chains (each node's parent the one before it) are masked for all rows at once by llguidance's parallel fill
    along the drafts (in Rust, off the GIL); a row whose grammar forbids one of its drafts, or stops within them,
    is masked node by node as a tree is (where forced tokens may replace its drafts)."""
    rows = tokens.shape[0]
    masked = tokens.shape[1] if nodes is None else min(nodes, tokens.shape[1])
    tokens = tokens.copy()
    substituted = np.zeros(rows, bool)
    out = np.full((rows, tokens.shape[1], bitmask_words(vocab_size)), -1, np.int32)
    pending = [b for b, matcher in enumerate(matchers) if matcher is not None]
    if pending and masked > 1 and _is_chain(mask[:, :masked, :masked]):
        pending = _mask_chains(matchers, pending, tokens[:, :masked], out, vocab_size)
    depth = mask.sum(axis=-1) - 1
    for b in pending:
        substituted[b] = _constrain_row(matchers[b], tokens[b], mask[b], depth[b], out[b], masked, vocab_size,
                                        substitute)
    return out, tokens, substituted


def _is_chain(mask: np.ndarray) -> bool:
    """Whether every row's tree (ancestry mask bool[B, T, T]) is a chain: node n's ancestors are nodes 0..n."""
    return bool((mask == np.tril(np.ones(mask.shape[1:], bool))).all())


def _mask_chains(matchers: list, rows: list[int], tokens: np.ndarray, out: np.ndarray, vocab_size: int) -> list[int]:
    """Masks the chains of ``rows`` (tokens i32[B, K]: the root, then K - 1 drafts) into out[b, :K] in one
    parallel fill along each row's drafts -> the rows it could not mask: a draft out of the vocabulary, forbidden
    at its parent, or after the grammar's end, or a node the grammar allows nothing at (all for
    :func:`_constrain_row`)."""
    from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

    nodes = tokens.shape[1]
    drafts = tokens[rows, 1:]
    in_vocabulary = ((drafts >= 0) & (drafts < vocab_size)).all(axis=1)
    rest = [b for b, ok in zip(rows, in_vocabulary) if not ok]
    rows, drafts = [b for b, ok in zip(rows, in_vocabulary) if ok], drafts[in_vocabulary]
    if not rows:
        return rest
    flat = np.zeros((len(rows) * nodes, out.shape[-1]), np.int32)
    fill_next_token_bitmask_par_with_draft_tokens(
        _executor(), [(matchers[b], i * nodes, drafts[i].tolist()) for i, b in enumerate(rows)], flat)
    flat = flat.reshape(len(rows), nodes, -1)
    clipped = np.clip(drafts, 0, 32 * flat.shape[-1] - 1)
    words = np.take_along_axis(flat[:, :-1], (clipped // 32)[..., None], axis=2)[..., 0]
    fine = (((words >> (clipped % 32)) & 1) == 1).all(axis=1)  # each draft allowed at its parent
    fine &= flat.any(axis=2).all(axis=1)  # no node past the grammar's end (nothing allowed)
    fine &= np.asarray([not matchers[b].is_stopped() for b in rows])
    out[np.asarray(rows)[fine], :nodes] = flat[fine]
    return rest + [b for b, ok in zip(rows, fine) if not ok]


def _constrain_row(matcher, tokens: np.ndarray, mask: np.ndarray, depth: np.ndarray, out: np.ndarray, masked: int,
                   vocab_size: int, substitute: bool) -> bool:
    """One row of :func:`constrain_tree`, node by node (tokens i32[T], mask bool[T, T], depth i32[T]; out i32[T, W]
    written, tokens where substituted) -> whether a draft was substituted."""
    substituted = False
    _fill(matcher, out, 0)
    reachable = np.zeros(tokens.shape[0], bool)
    reachable[0] = True
    for n in np.argsort(depth[:masked], kind="stable")[1:]:
        ancestors = np.nonzero(mask[n])[0]
        ancestors = ancestors[np.argsort(depth[ancestors], kind="stable")]  # root first, n last
        parent = ancestors[-2]
        if not reachable[parent]:
            continue
        path = tokens[ancestors[1:-1]].tolist()
        consumed = matcher.try_consume_tokens(path)  # the parent's state (reachable: all of the path)
        token = int(tokens[n])
        if substitute and not _allowed(out[parent], token):
            forced = matcher.compute_ff_tokens()
            if forced:
                token = tokens[n] = forced[0]
                substituted = True
        if (0 <= token < vocab_size and not matcher.is_stopped() and _allowed(out[parent], token)
                and matcher.consume_token(token)):
            reachable[n] = True
            _fill(matcher, out, n)
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
    return substituted


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for parallel mask fills (one per process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    return _EXECUTOR


def with_forced_drafts(tree, tokens: np.ndarray, substituted: np.ndarray):
    """The DraftTree ``tree`` with :func:`constrain_tree`'s ``tokens`` and, where ``substituted``, its rows marked
    as having drafted their whole tree (``drafted``, ``full``); each array placed as the one it replaces, so the
    verify program is the one already compiled."""
    import jax

    def like(old, value):
        return jax.device_put(np.asarray(value, old.dtype), old.sharding)

    flags = {name: like(getattr(tree, name), np.asarray(jax.device_get(getattr(tree, name))) | substituted)
             for name in ("drafted", "full") if getattr(tree, name) is not None}
    return tree._replace(tokens=like(tree.tokens, tokens), **flags)


def constrain_proposal(matchers: list, tree, vocab_size: int, *, greedy: bool, nodes: int | None = None):
    """A drafter's proposal (a DraftTree on the device) under each row's grammar, between the propose and verify
    programs of a structured step -> (the tree to verify, its token bitmask [B, T, words]): every node masked from
    its path's grammar state (:func:`constrain_tree`), and where a grammar forbids a row's drafts, the tokens it
    forces drafted instead (:func:`with_forced_drafts`) when that cannot change what verification accepts: for
    deterministic drafts, or when every row is greedy (``greedy``; verification then ignores ``draft_probs``).
    nodes: the nodes the step verifies (a short chain's first; default all), the only ones masked."""
    from jspec.sharding import to_host

    bitmask, tokens, substituted = constrain_tree(matchers, to_host(tree.tokens), to_host(tree.mask), vocab_size,
                                                  substitute=tree.draft_probs is None or greedy, nodes=nodes)
    if substituted.any():  # a row given forced drafts now has drafts to verify, all of its chain
        tree = with_forced_drafts(tree, tokens, substituted)
    return tree, bitmask


def _allowed(bitmask: np.ndarray, token: int) -> bool:
    """Whether token's bit is set in one node's bitmask i32[W]."""
    return 0 <= token < 32 * bitmask.shape[0] and bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def advance(matchers: list, tokens: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
    """Each row's grammar consumes its newly committed tokens tokens[b, start[b]:end[b]] (up to its end: a finished
    grammar allows only EOS, which stops the sequence); a token the grammar rejects means a mask let it through:
    RuntimeError."""
    for b, matcher in enumerate(matchers):
        for token in tokens[b, start[b]:end[b]].tolist() if matcher is not None else ():
            if matcher.is_stopped():
                break
            if not matcher.consume_token(token):
                raise RuntimeError(f"row {b}: the grammar rejected committed token {token} ({matcher.get_error()})")


def _fill(matcher, rows: np.ndarray, index: int) -> None:
    """rows[index] = the matcher's allowed tokens; all allowed where it allows none (past the grammar's end: the
    sequence stops there, and -inf everywhere would make that node's softmax NaN)."""
    from llguidance.numpy import fill_next_token_bitmask

    fill_next_token_bitmask(matcher, rows, index)
    if not rows[index].any():
        rows[index] = -1

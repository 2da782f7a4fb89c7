"""Medusa and EAGLE proposers on the real SmolLM2 target: drafts against direct/brute-force
recomputation, incremental state against from-scratch, trees against chains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from threefold.errors import ThreefoldError
from threefold.spec.config import SpeculativeConfig
from threefold.spec.heads import EagleHead, HeadsConfig, MedusaHeads, save_heads
from threefold.spec.proposer import ROOT, DraftRequest, make_proposer
from threefold.spec.train import causal_attention
from threefold.spec.tree import eagle2_tree


@pytest.fixture(scope="module")
def context(smollm2_fp32):
    """Tokens x_0..x_{L-1} and the target's features f_0..f_{L-2} (x_{L-1} the target's greedy choice)."""
    model = smollm2_fp32.model
    ids = smollm2_fp32.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), causal_attention)
        next_id = int(model.compute_logits(hidden[-1:]).argmax())
    return [*ids, next_id], hidden.clone()


def random_heads(method, smollm2_fp32, path, num_heads=3, draft_vocab=None, draft_vocab_size=0):
    torch.manual_seed(0)
    arch = smollm2_fp32.config
    heads = MedusaHeads(arch.hidden_size, num_heads) if method == "medusa" else EagleHead(arch)
    with torch.no_grad():  # Medusa starts as the identity; give every head its own map
        for param in heads.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.02)
    save_heads(path, HeadsConfig(method, arch.hidden_size, arch.vocab_size, "smollm2-135m", num_heads,
                                 draft_vocab_size=draft_vocab_size), heads, draft_vocab)
    return heads


def test_medusa_chain_and_tree(smollm2_fp32, context, tmp_path):
    heads = random_heads("medusa", smollm2_fp32, tmp_path)
    tokens, hidden = context
    proposer = make_proposer(SpeculativeConfig("medusa", 3, model=str(tmp_path)), smollm2_fp32)
    (draft,) = proposer.propose([DraftRequest("r", tokens, 2, hidden)])
    with torch.inference_mode():
        logits = smollm2_fp32.model.compute_logits(heads(hidden[-1:])[:, 0])  # [num_heads, vocab]
    assert draft.token_ids == logits.argmax(-1)[:2].tolist() and not draft.is_tree
    assert proposer.propose([DraftRequest("r", tokens, 2, None)])[0].token_ids == []
    tree = make_proposer(SpeculativeConfig("medusa", 3, model=str(tmp_path),
                                           speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"),
                         smollm2_fp32)
    (draft,) = tree.propose([DraftRequest("r", tokens, 2, hidden)])  # depth 2: the depth-3 node is left out
    top = logits.topk(2, -1).indices
    assert draft.token_ids == [top[0, 0], top[0, 1], top[1, 0], top[1, 1]]
    assert draft.parent_ids == [ROOT, ROOT, 0, 0]
    with pytest.raises(ThreefoldError, match="exceeds the 3 Medusa heads"):
        make_proposer(SpeculativeConfig("medusa", 4, model=str(tmp_path)), smollm2_fp32)
    with pytest.raises(ThreefoldError, match="holds medusa heads, not eagle"):
        make_proposer(SpeculativeConfig("eagle", 3, model=str(tmp_path)), smollm2_fp32)


def brute_force_eagle_chain(head, model, tokens, hidden, k, vocab=None):
    """Recompute the head over every pair from scratch for each drafted token; vocab: the argmax
    taken over only these token ids."""
    features, pair_tokens = list(hidden), list(tokens[1:])
    drafts = []
    with torch.inference_mode():
        for _ in range(k):
            num = len(pair_tokens)
            embeds = F.embedding(torch.tensor(pair_tokens), model.embed_tokens.weight)
            predicted = head(torch.stack(features), embeds, torch.arange(1, num + 1), causal_attention)
            logits = model.compute_logits(predicted[-1:])[0]
            drafts.append(int(logits.argmax()) if vocab is None else int(vocab[logits[vocab].argmax()]))
            features.append(predicted[-1])
            pair_tokens.append(drafts[-1])
    return drafts


def test_eagle_chain_matches_brute_force_and_is_incremental(smollm2_fp32, context, tmp_path):
    head = random_heads("eagle", smollm2_fp32, tmp_path)
    tokens, hidden = context
    config = SpeculativeConfig("eagle", 4, model=str(tmp_path))
    proposer = make_proposer(config, smollm2_fp32)
    (whole,) = proposer.propose([DraftRequest("a", tokens, 4, hidden)])
    assert whole.token_ids == brute_force_eagle_chain(head, smollm2_fp32.model, tokens, hidden, 4)
    # The same context fed in two steps (prefill, then two more verified tokens) drafts the same.
    split = len(hidden) - 2
    proposer.propose([DraftRequest("b", tokens[: split + 1], 4, hidden[:split], 0)])
    (stepped,) = proposer.propose([DraftRequest("b", tokens, 4, hidden[split:], split)])
    assert stepped.token_ids == whole.token_ids
    # Recomputed positions (after a preemption) replace the cached ones instead of piling up.
    (again,) = proposer.propose([DraftRequest("b", tokens, 4, hidden[split - 3 :], split - 3)])
    assert again.token_ids == whole.token_ids and proposer.states["b"].length == len(hidden)
    # Without a feature for the newest token there is nothing to draft from.
    assert proposer.propose([DraftRequest("b", [*tokens, 5], 4, None)])[0].token_ids == []
    proposer.remove("b")
    assert "b" not in proposer.states


def test_eagle_tree(smollm2_fp32, context, tmp_path):
    random_heads("eagle", smollm2_fp32, tmp_path)
    tokens, hidden = context
    chain = make_proposer(SpeculativeConfig("eagle", 3, model=str(tmp_path)), smollm2_fp32)
    tree = make_proposer(SpeculativeConfig("eagle", 3, model=str(tmp_path), tree_top_k=3, tree_total_tokens=8),
                         smollm2_fp32)
    (path,) = chain.propose([DraftRequest("r", tokens, 3, hidden)])
    (draft,) = tree.propose([DraftRequest("r", tokens, 3, hidden)])
    assert draft.is_tree and len(draft.token_ids) == 8
    assert all(p == ROOT or p < i for i, p in enumerate(draft.parent_ids))
    # The greedy chain is the tree's best-first path: its first node is the root's best child.
    assert draft.token_ids[0] == path.token_ids[0] and draft.parent_ids[0] == ROOT
    node, walked = 0, [draft.token_ids[0]]
    for _ in range(2):
        children = [i for i, p in enumerate(draft.parent_ids) if p == node]
        if not children:
            break
        node = children[0]
        walked.append(draft.token_ids[node])
    assert walked == path.token_ids[: len(walked)]


def brute_force_logprobs(head, model, tokens, hidden, path):
    """The head's next-token log-probs after drafting `path` (forced tokens), recomputed over every
    pair from scratch: no cache, no mask but causal."""
    features, pair_tokens = list(hidden), list(tokens[1:])

    def run():
        embeds = F.embedding(torch.tensor(pair_tokens), model.embed_tokens.weight)
        return head(torch.stack(features), embeds, torch.arange(1, len(pair_tokens) + 1), causal_attention)

    with torch.inference_mode():
        for token in path:
            features.append(run()[-1])
            pair_tokens.append(token)
        return torch.log_softmax(model.compute_logits(run()[-1:])[0], -1)


def test_eagle_tree_matches_brute_force_at_every_node(smollm2_fp32, context, tmp_path):
    """EAGLE-2's tree from the proposer (the head's cache, one masked call per depth) equals the tree
    grown from brute-force log-probs, each node's recomputed along its own path: every node sees its
    ancestors and not its cousins."""
    head = random_heads("eagle", smollm2_fp32, tmp_path)
    tokens, hidden = context
    tree = make_proposer(SpeculativeConfig("eagle", 3, model=str(tmp_path), tree_top_k=3, tree_total_tokens=10),
                         smollm2_fp32)
    (draft,) = tree.propose([DraftRequest("r", tokens, 3, hidden)])

    def path(node, token_ids, parent_ids):
        out = []
        while node != ROOT:
            out.insert(0, token_ids[node])
            node = parent_ids[node]
        return out

    def expand(frontier, token_ids, parent_ids):
        return torch.stack([brute_force_logprobs(head, smollm2_fp32.model, tokens, hidden,
                                                 path(n, token_ids, parent_ids)) for n in frontier])

    root = brute_force_logprobs(head, smollm2_fp32.model, tokens, hidden, [])
    expected = eagle2_tree(root, expand, 3, 3, 10)
    assert draft.token_ids == expected.token_ids and draft.parent_ids == expected.parent_ids
    assert len(set(draft.parent_ids)) > 2  # a real tree: several nodes have children


def test_heads_found_by_name_under_threefold_home(smollm2_fp32, tmp_path, monkeypatch):
    random_heads("medusa", smollm2_fp32, tmp_path / "heads" / "my-heads")
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
    proposer = make_proposer(SpeculativeConfig("medusa", 2, model="my-heads"), smollm2_fp32)
    assert proposer.heads.num_heads == 3
    with pytest.raises(ThreefoldError, match="holds no draft heads"):
        make_proposer(SpeculativeConfig("medusa", 2, model="other-heads"), smollm2_fp32)


def ranked_vocab(smollm2_fp32, size=3000):
    """A ranked draft vocabulary of `size` ids spread over the whole vocabulary (seeded)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randperm(smollm2_fp32.config.vocab_size, generator=generator)[:size]


def test_draft_vocabulary_drafts_the_best_token_inside_it(smollm2_fp32, context, tmp_path):
    """FR-Spec: with draft_vocab_size N the heads' argmax is over the first N ranked ids only,
    through a sliced LM head that computes the full head's rows for them."""
    tokens, hidden = context
    vocab = ranked_vocab(smollm2_fp32)
    head = random_heads("eagle", smollm2_fp32, tmp_path / "eagle", draft_vocab=vocab, draft_vocab_size=2000)
    model = smollm2_fp32.model
    sliced = make_proposer(SpeculativeConfig("eagle", 4, model=str(tmp_path / "eagle")), smollm2_fp32)
    assert sliced.lm_head.size == 2000
    with torch.inference_mode():
        torch.testing.assert_close(sliced.lm_head(hidden[-3:]), model.compute_logits(hidden[-3:])[:, vocab[:2000]],
                                   atol=1e-4, rtol=1e-5)
    (draft,) = sliced.propose([DraftRequest("a", tokens, 4, hidden)])
    assert draft.token_ids == brute_force_eagle_chain(head, model, tokens, hidden, 4, vocab[:2000])
    assert set(draft.token_ids) <= set(vocab[:2000].tolist())
    full = make_proposer(SpeculativeConfig("eagle", 4, model=str(tmp_path / "eagle"), draft_vocab_size=0),
                         smollm2_fp32)
    (whole,) = full.propose([DraftRequest("a", tokens, 4, hidden)])
    assert full.lm_head.size == smollm2_fp32.config.vocab_size
    assert whole.token_ids == brute_force_eagle_chain(head, model, tokens, hidden, 4)
    assert whole.token_ids[0] not in vocab[:2000].tolist()  # the slice really changed the draft
    tree = make_proposer(SpeculativeConfig("eagle", 3, model=str(tmp_path / "eagle"), tree_top_k=3,
                                           tree_total_tokens=8, draft_vocab_size=500), smollm2_fp32)
    (nodes,) = tree.propose([DraftRequest("a", tokens, 3, hidden)])
    assert len(nodes.token_ids) == 8 and set(nodes.token_ids) <= set(vocab[:500].tolist())
    assert nodes.token_ids[0] == brute_force_eagle_chain(head, model, tokens, hidden, 1, vocab[:500])[0]

    medusa = random_heads("medusa", smollm2_fp32, tmp_path / "medusa", draft_vocab=vocab, draft_vocab_size=1000)
    proposer = make_proposer(SpeculativeConfig("medusa", 3, model=str(tmp_path / "medusa")), smollm2_fp32)
    (draft,) = proposer.propose([DraftRequest("r", tokens, 3, hidden)])
    with torch.inference_mode():
        logits = model.compute_logits(medusa(hidden[-1:])[:, 0])[:, vocab[:1000]]  # [num_heads, 1000]
    assert draft.token_ids == vocab[:1000][logits.argmax(-1)].tolist()


def test_draft_vocabulary_refuses_what_the_heads_cannot_give(smollm2_fp32, context, tmp_path):
    vocab = ranked_vocab(smollm2_fp32)
    random_heads("eagle", smollm2_fp32, tmp_path / "ranked", draft_vocab=vocab)
    with pytest.raises(ThreefoldError, match="wrote only 3000 distinct tokens"):
        make_proposer(SpeculativeConfig("eagle", 2, model=str(tmp_path / "ranked"), draft_vocab_size=3001),
                      smollm2_fp32)
    assert make_proposer(SpeculativeConfig("eagle", 2, model=str(tmp_path / "ranked")),
                         smollm2_fp32).lm_head.size == smollm2_fp32.config.vocab_size  # the heads' default: 0
    random_heads("eagle", smollm2_fp32, tmp_path / "old")  # trained before heads kept a vocabulary
    with pytest.raises(ThreefoldError, match="carry no draft vocabulary"):
        make_proposer(SpeculativeConfig("eagle", 2, model=str(tmp_path / "old"), draft_vocab_size=100), smollm2_fp32)
    with pytest.raises(ThreefoldError, match="draft_vocab_size slices"):
        SpeculativeConfig("ngram", 2, draft_vocab_size=100)
    with pytest.raises(ThreefoldError, match="non-negative integer"):
        SpeculativeConfig("eagle", 2, model="x", draft_vocab_size=-1)

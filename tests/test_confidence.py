"""Answer probabilities from hand-built vLLM log-probability lists (docs: vidlabel.serve.confidence)."""

import functools
import json
import math

import numpy as np
import pytest

from vidlabel.core import prompt
from vidlabel.serve import confidence
from vidlabel.serve.confidence import answer_probabilities, logprobs_request

Q1 = [{"id": "q1", "text": "First?"}]
Q12 = [{"id": "q1", "text": "First?"}, {"id": "q2", "text": "Second?"}]


def _as_bytes(token):
    return token if isinstance(token, bytes) else token.encode()


def _entry(token, alternatives=None, with_bytes=True):
    """One element of choices[0].logprobs.content. ``alternatives``: {token: probability} including the
    chosen token (None: a token the grammar forced, probability 1)."""
    alternatives = alternatives if alternatives is not None else {token: 1.0}

    def item(tok, p):
        raw = _as_bytes(tok)
        out = {"token": raw.decode("utf-8", errors="replace"), "logprob": math.log(p) if p > 0 else -9999.0}
        if with_bytes:
            out["bytes"] = list(raw)
        return out

    chosen = item(token, alternatives.get(token, 0.01))
    chosen["top_logprobs"] = [item(t, p) for t, p in sorted(alternatives.items(), key=lambda kv: -kv[1])]
    return chosen


def _content(*tokens):
    """Entries from plain tokens (forced) and (token, alternatives) pairs."""
    return [_entry(t) if isinstance(t, (str, bytes)) else _entry(*t) for t in tokens]


def _text(content):
    return b"".join(bytes(e["bytes"]) if "bytes" in e else e["token"].encode() for e in content).decode()


YES_NO_START = {"y": 0.1, "ye": 0.2, "yes": 0.3, "n": 0.15, "no": 0.25}


def test_probability_of_an_answer_sums_every_first_token_that_spells_it():
    content = _content('{"', "q1", '":"', ("yes", YES_NO_START), '"}')
    assert _text(content) == '{"q1":"yes"}'
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {}
    assert probs["q1"]["yes"] == pytest.approx(0.6)
    assert probs["q1"]["no"] == pytest.approx(0.4)


def test_the_same_distribution_under_another_tokenisation_gives_the_same_probabilities():
    # "y" then "es" instead of "yes": the first token already decides the answer.
    one = answer_probabilities(_content('{"', "q1", '":"', ("yes", YES_NO_START), '"}'), Q1).probs
    two = answer_probabilities(_content('{"', "q1", '":"', ("y", YES_NO_START), "es", '"}'), Q1).probs
    three = answer_probabilities(_content('{"', "q1", '":"', ("ye", YES_NO_START), ("s", {"s": 1.0}), '"}'),
                                 Q1).probs
    assert one == two == three


def test_several_questions_with_keys_split_across_tokens():
    start_q1 = {"y": 0.1, "ye": 0.2, "yes": 0.3, "no": 0.4}  # no other way to spell q1's "no": q2 fully observed
    start_q2 = {"n": 0.5, "no": 0.3, 'no"}': 0.1, "y": 0.1}
    content = _content('{"', "q", '1":"', ("no", start_q1), '","', "q", "2", '":"', ("no", start_q2), '"}')
    assert _text(content) == '{"q1":"no","q2":"no"}'
    probs, missing = answer_probabilities(content, Q12)
    assert missing == {}
    assert probs["q1"]["no"] == pytest.approx(0.4)
    assert probs["q2"] == pytest.approx({"yes": 0.1, "no": 0.9})
    assert all(sum(p.values()) == pytest.approx(1) for p in probs.values())


def test_value_starting_inside_a_token_is_read_conditional_on_the_forced_key_tail():
    # The chosen token '":"no' holds the end of the key and the answer; '":"' (0.05) ends before the
    # value and was not taken, so its share is apportioned 5:4 like the decided alternatives, and
    # '":' followed by something else than '"' (0.1) is not on this path at all.
    alternatives = {'":"no': 0.3, '":"n': 0.1, '":"y': 0.25, '":"yes': 0.2, '":"': 0.05, '":x': 0.1}
    content = _content('{"', "q1", ('":"no', alternatives), '"}')
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {}
    assert probs["q1"]["yes"] == pytest.approx(0.45 / 0.85)
    assert probs["q1"]["no"] == pytest.approx(0.40 / 0.85)


def test_chosen_token_fitting_two_answers_is_split_by_the_next_position(monkeypatch):
    monkeypatch.setitem(prompt.ANSWER_CHOICES, "tone", ["pos", "positive", "neg"])
    questions = [{"id": "t", "text": "Tone?", "type": "tone"}]
    first = {"pos": 0.5, "p": 0.1, "neg": 0.2, "ne": 0.2}  # "p" fits pos and positive and was not taken
    after_pos = {"itive": 0.6, '"': 0.3, '"}': 0.1}
    content = _content('{"', "t", '":"', ("pos", first), ("itive", after_pos), '"}')
    probs, missing = answer_probabilities(content, questions)
    assert missing == {}
    # Given "pos": positive 0.6, pos 0.4. The untaken "p" (0.1) follows that split.
    assert probs["t"]["positive"] == pytest.approx(0.6 * 0.6)
    assert probs["t"]["pos"] == pytest.approx(0.6 * 0.4)
    assert probs["t"]["neg"] == pytest.approx(0.4)


def test_tokens_that_split_a_utf8_character_are_rebuilt_from_their_bytes(monkeypatch):
    monkeypatch.setitem(prompt.ANSWER_CHOICES, "si/no", ["sí", "no"])
    questions = [{"id": "q1", "text": "¿Sí?", "type": "si/no"}]
    i_acute = "í".encode()
    assert len(i_acute) == 2
    start = {"s": 0.7, "n": 0.1, "no": 0.2}
    after_s = {i_acute[:1]: 1.0}
    content = _content('{"', "q1", '":"', ("s", start), (i_acute[:1], after_s), i_acute[1:] + b'"}')
    assert "\ufffd" in content[4]["token"]  # the token string alone cannot rebuild the text
    probs, missing = answer_probabilities(content, questions)
    assert missing == {}
    assert probs["q1"] == pytest.approx({"sí": 0.7, "no": 0.3})


def test_tokens_without_bytes_are_read_from_their_strings():
    content = [_entry(t, a, with_bytes=False) for t, a in
               [('{"', None), ("q1", None), ('":"', None), ("no", YES_NO_START), ('"}', None)]]
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {} and probs["q1"]["no"] == pytest.approx(0.4)


def test_masked_alternatives_and_a_trailing_end_token_change_nothing():
    alternatives = {**YES_NO_START, "maybe": 0.0, "!": 0.0}  # -9999, as vLLM reports masked tokens
    content = _content('{"', "q1", '":"', ("yes", alternatives), '"}', "")
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {} and probs["q1"]["yes"] == pytest.approx(0.6)


def test_chosen_token_missing_from_top_logprobs_is_counted():
    entry = _entry("no", {"yes": 0.5, "y": 0.2, "n": 0.2})
    entry["logprob"] = math.log(0.1)  # sampled with temperature, below the listed ones
    content = _content('{"', "q1", '":"') + [entry] + _content('"}')
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {}
    assert probs["q1"] == pytest.approx({"yes": 0.7, "no": 0.3})


def test_missing_logprobs_leave_the_question_out_with_a_reason():
    assert answer_probabilities(None, Q12).missing == {
        "q1": "the response has no log-probabilities", "q2": "the response has no log-probabilities"}

    content = _content('{"', "q1", '":"', ("yes", YES_NO_START), '","', "q2", '":"', ("no", YES_NO_START), '"}')
    del content[7]["top_logprobs"]
    probs, missing = answer_probabilities(content, Q12)
    assert set(probs) == {"q1"} and "top_logprobs" in missing["q2"]

    content = _content('{"', "q1", '":"', ("yes", YES_NO_START), '"}')
    content[3]["top_logprobs"][0]["logprob"] = None
    assert "log-probability" in answer_probabilities(content, Q1).missing["q1"]

    assert "not an object" in answer_probabilities(["{", None], Q1).missing["q1"]
    content = _content('{"', "q1", '":"', ("yes", YES_NO_START), '"}')
    content[3]["top_logprobs"] = "yes"
    assert "top_logprobs" in answer_probabilities(content, Q1).missing["q1"]


def test_too_few_top_logprobs_leave_the_question_out():
    # Only "yes" (0.3) and "no" (0.25) listed: 45 % of the probability is unaccounted for.
    content = _content('{"', "q1", '":"', ("yes", {"yes": 0.3, "no": 0.25}), '"}')
    probs, missing = answer_probabilities(content, Q1)
    assert probs == {} and "45%" in missing["q1"]
    # A looser limit accepts it, apportioning the unlisted share like the listed one.
    probs, _ = answer_probabilities(content, Q1, max_unresolved=0.5)
    assert probs["q1"]["yes"] == pytest.approx(0.3 / 0.55)


def test_a_question_absent_from_the_answer_is_reported():
    content = _content('{"', "q1", '":"', ("yes", YES_NO_START), '"}')
    probs, missing = answer_probabilities(content, Q12)
    assert set(probs) == {"q1"} and "no string value" in missing["q2"]


def test_a_cut_answer_keeps_the_values_it_completed():
    content = _content('{"', "q1", '":"', ("no", YES_NO_START), '","', "q2", '":"', ("y", YES_NO_START))
    probs, missing = answer_probabilities(content, Q12)
    assert probs["q1"]["no"] == pytest.approx(0.4)
    assert "q2" in missing


def test_request_asks_for_as_many_alternatives_as_vllm_allows_by_default():
    assert logprobs_request() == {"logprobs": True, "top_logprobs": confidence.MAX_TOP_LOGPROBS}
    assert logprobs_request(5) == {"logprobs": True, "top_logprobs": 5} and logprobs_request(0) == {}
    assert confidence.MAX_TOP_LOGPROBS == 20


# --------------------------------------------------------------------------------------------
# Alternatives at positions before the value (issue: answer_probs drop them)

def test_an_alternative_before_the_value_that_decides_the_answer_is_counted():
    # The constructed worst case: '":"' (0.4) was chosen, after it "yes" is almost sure (0.998), but at
    # the same position '":"no' (0.6) already decides "no". P(yes) = 0.4 x 0.998, not 0.998.
    content = _content('{"', "q1", ('":"', {'":"': 0.4, '":"no': 0.6}), ("yes", {"yes": 0.998, "no": 0.002}), '"}')
    probs, missing = answer_probabilities(content, Q1)
    assert missing == {}
    assert probs["q1"]["yes"] == pytest.approx(0.4 * 0.998)


def test_tokenisation_variants_before_the_value_are_apportioned_and_bounded():
    # '":' (0.1) spells the same text as the chosen '":"' but its continuation was never computed.
    content = _content('{"', "q1", ('":"', {'":"': 0.9, '":': 0.1}), ("yes", {"yes": 0.7, "no": 0.3}), '"}')
    dist = confidence.answer_distributions(content, Q1).by_question["q1"]
    assert dist.probs == pytest.approx({"yes": 0.7, "no": 0.3})
    assert dist.unresolved == pytest.approx(0.1)
    # Above max_unresolved the question gets no probabilities, whichever position the share sits at.
    content = _content('{"', "q1", ('":"', {'":"': 0.6, '":': 0.4}), ("yes", {"yes": 0.7, "no": 0.3}), '"}')
    probs, missing = answer_probabilities(content, Q1)
    assert probs == {} and "40%" in missing["q1"]


def test_an_earlier_answer_conditions_the_next_question_and_its_variants_are_bounded():
    # q2's probabilities are conditional on q1's answer ("no"): q1's alternatives that spell "yes" are
    # another path, left out; "n" (another tokenisation of q1's "no") leaves q2 unobserved there.
    q1_start = {"yes": 0.3, "no": 0.6, "n": 0.1}
    content = _content('{"', "q1", '":"', ("no", q1_start), '","', "q2", '":"', ("yes", {"yes": 0.8, "no": 0.2}),
                       '"}')
    dist = confidence.answer_distributions(content, Q12).by_question
    assert dist["q1"].probs == pytest.approx({"yes": 0.3, "no": 0.7}) and dist["q1"].unresolved == 0
    assert dist["q2"].probs == pytest.approx({"yes": 0.8, "no": 0.2})
    assert dist["q2"].unresolved == pytest.approx(0.1 / 0.7)


# A small JSON-schema-like grammar: two yes/no questions, compact JSON. Every token path is enumerated
# to get the model's exact probabilities. RICH_VOCAB spells every piece in several ways (single
# characters included); in SPARSE_VOCAB the text before q1's value has one spelling, and the only
# alternatives before it ('":"y', '":"n') already decide q1: q1's probabilities are exact there.
RICH_VOCAB = ('{', '{"', '"', 'q', '1', '2', 'q1', 'q2', ':', '":', '":"', '":"y', '":"n', '":"yes', '":"no',
              ',', '",', '","', '","q', 'y', 'e', 's', 'ye', 'es', 'yes', 'yes"', 'n', 'o', 'no', 'no"', '}', '"}')
SPARSE_VOCAB = ('{"q1', '":"', '":"y', '":"n', 'yes', 'no', 'es', 'o', '","q2', '"}')
GRAMMAR_TEXTS = [f'{{"q1":"{a}","q2":"{b}"}}' for a in ("yes", "no") for b in ("yes", "no")]


@functools.lru_cache(maxsize=None)
def _node_probabilities(vocab, text, last, rng_seed, canonical):
    """The model's next-token distribution after ``text`` whose last token was ``last``, renormalised
    over the tokens the grammar allows: random logits drawn from (text, last token), so that the same
    text reached by another tokenisation continues differently, plus ``canonical`` per character on each
    allowed token (a trained model prefers the usual, longer tokens)."""
    allowed = [t for t in vocab if any(full.startswith(text + t) for full in GRAMMAR_TEXTS)]
    key = [rng_seed, len(text), *text.encode(), vocab.index(last) if last else len(vocab)]
    logits = np.random.default_rng(key).normal(0, 1.5, len(allowed)) + canonical * np.array([len(t) for t in allowed])
    p = np.exp(logits - logits.max())
    return dict(zip(allowed, p / p.sum()))


def _exact(vocab, rng_seed, canonical):
    """P(q1 = a, q2 = b) over every complete token path (by recursion over (text, last token), which
    is all the model's distribution depends on)."""

    @functools.lru_cache(maxsize=None)
    def finish(text, last):
        if text in GRAMMAR_TEXTS:
            answers = json.loads(text)
            return {(answers["q1"], answers["q2"]): 1.0}
        out = {}
        for token, p in _node_probabilities(vocab, text, last, rng_seed, canonical).items():
            for key, q in finish(text + token, token).items():
                out[key] = out.get(key, 0.0) + p * q
        return out

    return finish("", None)


def _sampled_content(vocab, rng_seed, canonical, path_seed):
    """One path drawn from the model, as vLLM reports it (every allowed token in top_logprobs)."""
    rng = np.random.default_rng(path_seed)
    text, last, content = "", None, []
    while text not in GRAMMAR_TEXTS:
        dist = _node_probabilities(vocab, text, last, rng_seed, canonical)
        tokens = list(dist)
        token = tokens[rng.choice(len(tokens), p=np.array(list(dist.values())))]
        content.append({"token": token, "logprob": math.log(dist[token]), "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())}
                                         for t, p in sorted(dist.items(), key=lambda kv: -kv[1])]})
        text, last = text + token, token
    return content, json.loads(text)


@pytest.mark.parametrize("vocab, canonical", [(RICH_VOCAB, 0.0), (RICH_VOCAB, 1.0), (RICH_VOCAB, 3.0),
                                              (SPARSE_VOCAB, 0.0)])
def test_brute_force_grammar_probabilities_lie_within_the_reported_bound(vocab, canonical):
    """On each of 40 sampled paths per case, every question's probabilities lie within the unresolved
    share of the exact ones (q1: its marginal; q2: conditional on q1's answer), and equal them where
    nothing is unresolved."""
    worst_gap, exact_cases = 0.0, 0
    for rng_seed in range(4):
        joint = _exact(vocab, rng_seed, canonical)
        assert sum(joint.values()) == pytest.approx(1)
        for path_seed in range(10):
            content, answers = _sampled_content(vocab, rng_seed, canonical, path_seed)
            dist = confidence.answer_distributions(content, Q12).by_question
            p_q1 = {a: sum(v for (x, _), v in joint.items() if x == a) for a in ("yes", "no")}
            given = {b: joint[(answers["q1"], b)] / p_q1[answers["q1"]] for b in ("yes", "no")}
            for qid, exact in (("q1", p_q1), ("q2", given)):
                d = dist[qid]
                gap = max(abs(d.probs[c] - exact[c]) for c in exact)
                assert gap <= d.unresolved + 1e-9, (rng_seed, path_seed, qid, d, exact)
                if d.unresolved == 0:
                    assert gap < 1e-9, (rng_seed, path_seed, qid, d, exact)
                    exact_cases += 1
                worst_gap = max(worst_gap, gap)
            assert answer_probabilities(content, Q12).probs.get("q1") == (
                dist["q1"].probs if dist["q1"].unresolved <= confidence.MAX_UNRESOLVED else None)
    assert worst_gap > 0.01  # the paths do disagree with the exact probabilities: the bound is needed
    # With SPARSE_VOCAB, a path that took '":"' observed every way q1 can go: nothing is apportioned.
    assert (exact_cases > 0) == (vocab is SPARSE_VOCAB)

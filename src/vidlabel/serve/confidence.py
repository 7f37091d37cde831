"""How sure the model was: per question, the probability of every allowed answer, from the log-probabilities
vLLM returns for the tokens of a JSON-schema (structured) answer.

Under a JSON-schema grammar vLLM (V1) masks the logits before it takes log-probabilities, so at each
position they are renormalised over the tokens the grammar allows. Where a question's value starts
(after ``"qid":"``) the allowed tokens are every way to begin spelling an allowed answer: for yes/no
e.g. ``y``, ``ye``, ``yes``, ``yes"``, ``yes",``, ``n``, ``no``, ``no"}``, ... The probability of an answer
is therefore not the chosen token's probability but the sum over the first tokens that can only spell
that answer. Further cases this module handles:

- Every position from the start of the answer counts, not only the one where the value starts: an
  alternative to ``":"`` such as ``":"no`` already decides the answer, and one such as ``":`` spells
  the same text another way and leads to every answer. Each position's alternatives are taken
  conditional on the text before it: an alternative that contradicts an earlier question's value
  belongs to another answer of that question and is left out, so a later question's probabilities
  are conditional on the earlier answers as given.
- An alternative shared by several answers (a prefix of two choices, a token that ends before the
  value starts, another tokenisation or spacing of the text before it). When the model chose it, the
  next position's log-probabilities give the split, recursively. When it did not, its continuation
  was never computed: its probability is shared among the answers it can still become in proportion
  to what the same position says about them (equally when it says nothing). Probability the
  top_logprobs do not list at all is treated the same way over every answer.
- Tokens that split UTF-8 characters: text is rebuilt from each token's ``bytes`` when present.

The share of the probability that rests on that apportioning (``QuestionProbabilities.unresolved``)
bounds how far any reported probability can be from the model's: the apportioned mass could belong to
any answer it fits. Above ``max_unresolved`` the question gets no probabilities. The probabilities steer
which posts people code (``vidlabel.analyze.label_sample``); an approximate probability costs interval
width there, never validity.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

from vidlabel.core.prompt import ANSWER_CHOICES

# vLLM's default --max-logprobs. The allowed first tokens of a yes/no value are the prefixes of both
# answers, each also followed by the closing quote and the punctuation after it, and at a mid-token start
# the same preceded by the tail of the key: over a dozen tokens, so the largest count the server allows.
# Every answer checks how much probability the listed tokens cover (``max_unresolved``).
MAX_TOP_LOGPROBS = 20


def logprobs_request(top_logprobs: int = MAX_TOP_LOGPROBS) -> dict[str, Any]:
    """What the chat-completion request must add so that the response carries
    ``choices[0].logprobs.content`` (``classify.top_logprobs``; 0: nothing)."""
    return {"logprobs": True, "top_logprobs": int(top_logprobs)} if top_logprobs else {}
# Largest share of a question's probability that may rest on apportioning alternatives whose
# continuation was not observed (or probability not listed at all).
MAX_UNRESOLVED = 0.25
# Listed probabilities summing to 1 within this are complete (exp of rounded logprobs leaves residue).
UNLISTED_TOLERANCE = 1e-9


class AnswerProbabilities(NamedTuple):
    """``probs``: {question id: {choice: probability}}, each summing to 1, for the questions whose
    log-probabilities determine them; ``missing``: {question id: why not} for every other question."""

    probs: dict[str, dict[str, float]]
    missing: dict[str, str]


class QuestionProbabilities(NamedTuple):
    """One question's ``probs`` ({choice: probability}) and ``unresolved``: the share of the probability
    apportioned among answers by assumption (alternatives whose continuation was not computed, and
    what top_logprobs did not list). The model's own probability of each answer lies within
    ``unresolved`` of the one given."""

    probs: dict[str, float]
    unresolved: float


class AnswerDistributions(NamedTuple):
    """``by_question``: {question id: QuestionProbabilities}; ``missing``: {question id: why not}."""

    by_question: dict[str, QuestionProbabilities]
    missing: dict[str, str]


class _Unavailable(Exception):
    """This question's probabilities cannot be read from the log-probabilities; the message says why."""


class _Position(NamedTuple):
    resolved: dict[bytes, float]     # probability of alternatives that can only spell this choice
    chosen_shared: float             # probability of the chosen token when it fits several choices (else 0)
    unresolved: list[tuple[float, frozenset]]  # alternatives not taken that fit several choices
    total: float                     # all probability that fits the forced text, plus what is unlisted


def answer_probabilities(content: list[dict[str, Any]] | None, questions: list[dict[str, Any]],
                         max_unresolved: float = MAX_UNRESOLVED) -> AnswerProbabilities:
    """Probabilities of every allowed answer per question, from ``choices[0].logprobs.content``.

    ``content``: vLLM's list of {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} for a
    compact JSON answer produced under the answer schema (``vidlabel.core.prompt.answer_schema``) with
    ``logprobs_request()`` in the request. Never raises for bad or incomplete log-probabilities: every
    question it cannot give probabilities for is in ``missing`` with the reason, also one whose
    unresolved share (``answer_distributions``) exceeds ``max_unresolved``.
    """
    by_question, missing = answer_distributions(content, questions)
    probs: dict[str, dict[str, float]] = {}
    for qid, d in by_question.items():
        if d.unresolved > max_unresolved:
            missing[qid] = (f"{d.unresolved:.0%} of the probability rests on alternatives whose continuation "
                            f"is unknown (limit {max_unresolved:.0%})")
        else:
            probs[qid] = d.probs
    return AnswerProbabilities(probs, missing)


def answer_distributions(content: list[dict[str, Any]] | None,
                         questions: list[dict[str, Any]]) -> AnswerDistributions:
    """Every question's answer probabilities with their unresolved share (see ``QuestionProbabilities``);
    the questions it cannot read are in ``missing`` with the reason. Never raises for bad input."""
    ids = [q["id"] for q in questions]
    if not content:
        return AnswerDistributions({}, {qid: "the response has no log-probabilities" for qid in ids})
    try:
        tokens = [_token_bytes(entry, i) for i, entry in enumerate(content)]
    except _Unavailable as exc:
        return AnswerDistributions({}, {qid: str(exc) for qid in ids})
    starts, offset = [], 0
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    text = b"".join(tokens)
    values = _string_values(text)
    by_question: dict[str, QuestionProbabilities] = {}
    missing: dict[str, str] = {}
    for q in questions:
        qid = q["id"]
        choices = ANSWER_CHOICES[q.get("type", "yes/no")]
        if qid not in values:
            missing[qid] = "the answer in the log-probabilities has no string value for this question"
            continue
        value_start, _ = values[qid]
        earlier = [span for span in values.values() if span[1] <= value_start]
        try:
            by_question[qid] = _question_probabilities(content, tokens, starts, text, value_start,
                                                       [c.encode() for c in choices], earlier)
        except _Unavailable as exc:
            missing[qid] = str(exc)
    return AnswerDistributions(by_question, missing)


# --------------------------------------------------------------------------------------------
# Tokens and text

def _token_bytes(entry: dict[str, Any], index: int) -> bytes:
    """A token's exact bytes: ``bytes`` when given (a token may hold part of a UTF-8 character, which
    its ``token`` string cannot show), else the UTF-8 of ``token``."""
    if not isinstance(entry, dict):
        raise _Unavailable(f"token {index} is not an object ({entry!r:.40})")
    raw = entry.get("bytes")
    if isinstance(raw, list):
        try:
            return bytes(raw)
        except (TypeError, ValueError):
            raise _Unavailable(f"token {index} has invalid bytes {raw!r}") from None
    token = entry.get("token")
    if not isinstance(token, str):
        raise _Unavailable(f"token {index} has neither bytes nor a token string")
    return token.encode("utf-8")


def _probability(entry: dict[str, Any], where: str) -> float:
    logprob = entry.get("logprob")
    if not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 1e-6:
        raise _Unavailable(f"{where} has no valid log-probability ({logprob!r})")
    return math.exp(min(logprob, 0.0))  # -inf and vLLM's -9999 (masked tokens) give 0


def _skip_space(text: bytes, i: int) -> int:
    while i < len(text) and text[i] in b" \t\r\n":
        i += 1
    return i


def _string_end(text: bytes, i: int) -> int:
    """Index just past the JSON string whose opening quote is at ``i``; -1 when it does not close."""
    i += 1
    while i < len(text):
        if text[i] == 0x5C:  # backslash: the next byte is escaped
            i += 2
            continue
        if text[i] == 0x22:
            return i + 1
        i += 1
    return -1


def _string_values(text: bytes) -> dict[str, tuple[int, int]]:
    """{key: (byte offset where its string value's content starts, offset just past its closing quote)}
    for the JSON object at the start of ``text``. Stops quietly at the first thing that is not ``"key":"value"`` (a cut answer keeps the
    values it completed; a trailing end-of-sequence token is ignored)."""
    values: dict[str, int] = {}
    i = _skip_space(text, 0)
    if text[i:i + 1] != b"{":
        return values
    i += 1
    while True:
        i = _skip_space(text, i)
        if text[i:i + 1] != b'"':
            return values
        key_end = _string_end(text, i)
        if key_end < 0:
            return values
        try:
            key = json.loads(text[i:key_end].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return values
        i = _skip_space(text, key_end)
        if text[i:i + 1] != b":":
            return values
        i = _skip_space(text, i + 1)
        if text[i:i + 1] != b'"':
            return values
        value_end = _string_end(text, i)
        if value_end < 0:
            return values
        values[key] = (i + 1, value_end)
        i = _skip_space(text, value_end)
        if text[i:i + 1] != b",":
            return values
        i += 1


# --------------------------------------------------------------------------------------------
# One question

def _fits(token: bytes, target: bytes) -> bool:
    """The token can be the start of ``target``, or ``target`` the start of the token."""
    n = min(len(token), len(target))
    return token[:n] == target[:n]


def _alternatives(entry: dict[str, Any], chosen: bytes, index: int) -> list[tuple[bytes, float, bool]]:
    """(bytes, probability, is the chosen token) for every listed alternative at one position; the chosen
    token is added when top_logprobs does not list it."""
    top = entry.get("top_logprobs")
    if not top or not isinstance(top, list):
        raise _Unavailable(f"token {index} has no top_logprobs (was top_logprobs requested?)")
    alternatives, chosen_seen = [], False
    for k, alt in enumerate(top):
        token = _token_bytes(alt, index)
        is_chosen = not chosen_seen and token == chosen
        chosen_seen |= is_chosen
        alternatives.append((token, _probability(alt, f"top_logprobs[{k}] of token {index}"), is_chosen))
    if not chosen_seen:
        alternatives.append((chosen, _probability(entry, f"token {index}"), True))
    return alternatives


def _divergence(token: bytes, text: bytes, start: int) -> int:
    """Offset in ``text`` of the first byte where ``token``, placed at ``start``, differs from it."""
    for k, byte in enumerate(token):
        if start + k >= len(text) or text[start + k] != byte:
            return start + k
    return start + len(token)


def _position(entry, chosen: bytes, start: int, text: bytes, value_start: int, choices: list[bytes],
              index: int, earlier: list[tuple[int, int]]) -> tuple[_Position, frozenset]:
    """What one position says about the value, and the choices its chosen token still fits. ``earlier``:
    the (start, end) spans of the values before this one."""
    emitted = text[value_start:start] if start > value_start else b""
    forced = text[start:value_start] if start < value_start else b""
    # What each choice still needs from this position on: the forced text up to the value, the rest of
    # the choice and the closing quote.
    targets = {c: forced + c[len(emitted):] + b'"' for c in choices if c.startswith(emitted)}
    resolved = {c: 0.0 for c in targets}
    chosen_shared, unresolved, listed, fitting, chosen_fits = 0.0, [], 0.0, 0.0, frozenset()
    for token, p, is_chosen in _alternatives(entry, chosen, index):
        listed += p
        fits = frozenset(c for c, target in targets.items() if _fits(token, target))
        if not fits:
            diverges = _divergence(token, text, start)
            if diverges >= value_start or any(s <= diverges < e for s, e in earlier):
                continue  # another answer to this or an earlier question: another path, conditioned away
            fits = frozenset(targets)  # the text before the value spelt otherwise (spacing): any answer
        fitting += p
        if is_chosen:
            chosen_fits = fits
        if len(fits) == 1:
            resolved[next(iter(fits))] += p
        elif is_chosen:
            chosen_shared = p
        else:
            unresolved.append((p, fits))
    unlisted = 1.0 - listed
    if unlisted > UNLISTED_TOLERANCE:
        unresolved.append((unlisted, frozenset(targets)))
    return _Position(resolved, chosen_shared, unresolved, fitting + unlisted), chosen_fits


def _question_probabilities(content, tokens, starts, text, value_start, choices, earlier) -> QuestionProbabilities:
    # Every position from the first token on, until the chosen tokens decide the answer: before the
    # value the chosen token fits every answer, and its alternatives may already decide one.
    chain: list[_Position] = []
    index = 0
    while True:
        if index >= len(content):
            raise _Unavailable("the tokens end before the answer is decided")
        position, chosen_fits = _position(content[index], tokens[index], starts[index], text, value_start,
                                          choices, index, earlier)
        if not chosen_fits:
            raise _Unavailable(f"token {index} does not fit any allowed answer")
        chain.append(position)
        if len(chosen_fits) == 1:
            break
        index += 1  # the chosen token fits several answers: the next position splits it

    # From the deciding position back to the first: each position's distribution over the choices,
    # conditional on the chosen tokens before it.
    following: dict[bytes, float] = {}
    unresolved_share = 0.0  # of the value's probability, from this position on
    for position in reversed(chain):
        if position.total <= 0:
            raise _Unavailable("the listed alternatives have no probability")
        informed = dict(position.resolved)
        for c, p in following.items():
            informed[c] = informed.get(c, 0.0) + position.chosen_shared * p
        mass = dict(informed)
        for p, fits in position.unresolved:
            weight = sum(informed.get(c, 0.0) for c in fits)
            for c in fits:
                mass[c] = mass.get(c, 0.0) + p * (informed.get(c, 0.0) / weight if weight > 0 else 1 / len(fits))
        unresolved_here = sum(p for p, _ in position.unresolved)
        unresolved_share = (unresolved_here + position.chosen_shared * unresolved_share) / position.total
        following = {c: m / position.total for c, m in mass.items()}
    total = sum(following.values())
    return QuestionProbabilities({c.decode(): following.get(c, 0.0) / total for c in choices},
                                 min(1.0, unresolved_share))

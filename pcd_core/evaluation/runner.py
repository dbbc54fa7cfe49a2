"""One model's answers on labelled examples, and the quality report built from them.

``read_answers`` fills each example raw (no debiasing, no calibration) and keeps, per field, the
probability row, the candidate mass and the gold index; it also runs the bench's AR-constrained
baseline (``pcd_core/bench/baselines.py``) on the same prompt, head and model. Every variant the report
compares (raw, debiased, calibrated) is computed from those same rows, so they differ only in the
post-processing: ``p / prior`` for debiasing (pcd_core/trust/debias.py), ``softmax(log p / T + b)`` for
calibration (pcd_core/trust/calibration_fitting.py). ``tests/test_eval.py`` runs it on the oracle engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import PcdError, PromptError, RequestError, TokenizationError
from pcd_core.evaluation import metrics
from pcd_core.evaluation.cache import AnswerCache, CachedAnswer, answer_key
from pcd_core.request.schema import Schema, parse_schema
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.calibration_fitting import BIAS_SD, fit
from pcd_core.trust.debias import PRIOR_FLOOR

logger = logging.getLogger(__name__)

#: what one input is refused for (empty, too long, merging with the prompt): such an example is left
#: out of the metrics and named in the report's ``refused``; any other error stops the run
INPUT_ERRORS = (PromptError, RequestError, TokenizationError)


@dataclass
class FieldAnswers:
    labels: tuple[str, ...]
    probabilities: list[list[float]] = field(default_factory=list)
    candidate_mass: list[float] = field(default_factory=list)
    gold: list[int] = field(default_factory=list)
    constrained_ar: list[int] = field(default_factory=list)  # the AR-constrained baseline's label index
    hidden: list[np.ndarray] = field(default_factory=list)  # read with hidden states: one per gold label
    texts: list[str] = field(default_factory=list)  # the example's text, one per gold label

    def states(self) -> np.ndarray:
        return np.asarray(self.hidden, dtype=np.float64)

    def array(self) -> np.ndarray:
        return np.asarray(self.probabilities, dtype=np.float64).reshape(-1, len(self.labels))


@dataclass
class Answers:
    schema: Schema | None  # None for answers to questions (read_question_answers)
    fields: dict[str, FieldAnswers]
    priors: dict[str, tuple[float, ...]]
    seconds: float = 0.0
    reused: int = 0  # examples whose answer came from an answers file, not the model (their time is not in seconds)
    # what the examples read now cost: the model's forward passes and the tokens they read (reused ones cost none)
    forward_passes: int = 0
    tokens_read: int = 0
    refused: list[dict[str, Any]] = field(default_factory=list)  # ``_refusal``s, in read order


def _spent(engine: Any, before: Any) -> dict[str, int]:
    """The passes and tokens this thread has run on ``engine`` since ``before`` (its counter's tally then)."""
    now = engine.backend.counter.mine()
    return {
        "forward_passes": now.forward_passes - before.forward_passes,
        "tokens_read": now.tokens_read - before.tokens_read,
    }


def _read_each(read: Callable[[list[str]], Sequence[Any]], texts: list[str]) -> list[Any]:
    """``read(texts)``; where it refuses an input (a batch is refused whole, before any pass), each
    text is read alone, so that a bad example costs its own answer only: its place holds the error.
    """
    if not texts:
        return []
    try:
        return list(read(texts))
    except INPUT_ERRORS as error:
        if len(texts) == 1:
            return [error]
    return [answer for text in texts for answer in _read_each(read, [text])]


def _refusal(index: int, text: str, error: Exception) -> dict[str, Any]:
    """How the report names an example refused for its input: its place among those read, its start."""
    return {"example": index, "text": text[:80], "error": str(error)}


def gold_index(schema: Schema, name: str, value: Any) -> int:
    spec = schema.field(name)
    for index, label in enumerate(spec.labels):
        if label.value == value or label.text == value:
            return index
    raise PcdError(f"field {name!r}: gold value {value!r} is not one of {[label.text for label in spec.labels]}")


def read_answers(
    engine: Any,
    schema: Any,
    records: list[dict[str, Any]],
    *,
    constrained: int | None = None,
    progress: bool = True,
    cache: AnswerCache | None = None,
    hidden: bool = False,
    batch_size: int = 1,
) -> Answers:
    """Fill every record raw; the first ``constrained`` records (all when None) are also decided by AR
    constrained by the schema's grammar, which costs a forward pass per written token. A record whose
    answer ``cache`` holds (pcd_core/evaluation/cache.py) is not read again. ``hidden`` also keeps
    each field's hidden state at its first decision point, from the same fill (what heads fit on).
    The records not cached are read ``batch_size`` at a time with ``fill_many``
    (``pcd_core/planning/batching.py``: the answers of one-at-a-time fills, in fewer passes).
    """
    from pcd_core.bench.baselines import ar_cap, generate_grammar
    from pcd_core.bench.checks import parse_lenient

    parsed = parse_schema(schema)
    names = [f.name for f in parsed.fields]
    answers = {f.name: FieldAnswers(tuple(label.text for label in f.labels)) for f in parsed.fields}
    started = time.perf_counter()
    head = engine.warmup(schema)
    priors = engine.content_free_priors(schema)
    compiled = engine.compile(schema)
    reused = 0
    refused: list[dict[str, Any]] = []
    counted = engine.backend.counter.mine()
    parts = engine.backend.hidden_parts if hidden else None
    bar = tqdm(total=len(records), desc="eval", unit="ex", disable=not progress, mininterval=2.0)
    for first in range(0, len(records), batch_size):
        chunk = records[first : first + batch_size]
        keys = [answer_key(engine.model_name, schema, record["text"]) for record in chunk]
        found = [
            cache.get(key, needs_constrained=constrained is None or first + k < constrained, needs_hidden=parts)
            if cache
            else None
            for k, key in enumerate(keys)
        ]
        missing = [k for k, answer in enumerate(found) if answer is None]
        texts = [chunk[k]["text"] for k in missing]
        fills = _read_each(
            lambda some: engine.fill_many(schema, some, debias=False, calibrate=False, hidden=hidden), texts
        )
        results = dict(zip(missing, fills))  # raw, whatever the defaults
        for k, (record, key, answer) in enumerate(zip(chunk, keys, found)):
            with_ar = constrained is None or first + k < constrained
            reused += answer is not None
            if answer is None and isinstance(results[k], INPUT_ERRORS):
                refused.append(_refusal(first + k, record["text"], results[k]))
                continue
            if answer is None:
                picks = None
                if with_ar:
                    # AR under llguidance's mask over the whole object, as pcd bench runs it; its written
                    # values are read back leniently, and a value it never wrote counts as wrong
                    run = generate_grammar(engine, compiled, head, record["text"], 4 * ar_cap(len(names)))
                    written = parse_lenient(compiled.schema, run.text)
                    picks = {name: _written_label(parsed, name, written) for name in names}
                result = results[k]
                answer = CachedAnswer(
                    {name: list(result.fields[name].probabilities.values()) for name in names},
                    {name: result.fields[name].candidate_mass for name in names},
                    picks,
                    # as the answers file keeps them (float16), so that a refit from it is the same fit
                    {n: np.asarray(result.fields[n].hidden, np.float16).astype(np.float32) for n in names}
                    if hidden
                    else None,
                    parts or FINAL_STATE,
                )
                if cache is not None:
                    cache.put(key, answer)
            gold = {n: gold_index(parsed, n, record["labels"][n]) for n in names if n in record["labels"]}
            _keep(answers, record["text"], gold, answer, with_ar, hidden)
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - started
    return Answers(parsed, answers, priors, seconds, reused, **_spent(engine, counted), refused=refused)


def _written_label(schema: Schema, name: str, written: Mapping[str, Any]) -> int:
    """The label index the baseline wrote for ``name``; -1 for a value it never wrote or that means none."""
    from pcd_core.bench.checks import label_of

    picked = label_of(schema.field(name), written[name]) if name in written else None
    return -1 if picked is None else picked


def _keep(
    answers: dict[str, FieldAnswers],
    text: str,
    gold: Mapping[str, int],
    answer: CachedAnswer,
    with_ar: bool,
    hidden: bool,
) -> None:
    """Add one example's answer to every decision it has a gold label for."""
    for name, index in gold.items():
        out = answers[name]
        out.texts.append(text)
        out.probabilities.append(answer.probabilities[name])
        out.candidate_mass.append(answer.candidate_mass[name])
        out.gold.append(index)
        if with_ar and answer.constrained_ar is not None:
            out.constrained_ar.append(answer.constrained_ar[name])
        if hidden and answer.hidden is not None:
            out.hidden.append(answer.hidden[name])


def read_question_answers(
    engine: Any,
    questions: dict[str, Any],
    records: list[dict[str, Any]],
    *,
    progress: bool = True,
    cache: AnswerCache | None = None,
    order_samples: int = 1,
    batch_size: int = 1,
) -> Answers:
    """Decide every record's questions raw (``engine.decide``, the call behind ``/v1/systemone``), so
    that a calibration is fitted on the prompt it will be applied to. A record's ``labels`` are keyed by
    question id: a boolean (or ``"true"``/``"false"``) for a noul, an option for a choice, a level index
    for a score. The answers' names are the labels (``answer_names``), as ``Engine.decide`` looks
    them up in a calibration. A record whose answer ``cache`` holds is not read again. ``order_samples``
    is ``Engine.decide``'s (its answers are kept apart from those read in one order). The records not
    cached are read ``batch_size`` at a time with ``decide_many``.
    """
    from pcd_core.request.questions import DecideRequest, answer_names, distribution

    asked = DecideRequest(state="", questions=questions).questions
    answers = {qid: FieldAnswers(answer_names(q)) for qid, q in asked.items()}
    started = time.perf_counter()
    priors = engine.question_priors(asked, order_samples)
    reused = 0
    refused: list[dict[str, Any]] = []
    counted = engine.backend.counter.mine()
    raw = {"debias": False, "calibrate": False, "order_samples": order_samples}
    scope = questions if order_samples == 1 else {"questions": questions, "order_samples": order_samples}
    bar = tqdm(total=len(records), desc="eval", unit="ex", disable=not progress, mininterval=2.0)
    for first in range(0, len(records), batch_size):
        chunk = records[first : first + batch_size]
        keys = [answer_key(engine.model_name, scope, record["text"]) for record in chunk]
        found = [cache.get(key, needs_constrained=False) if cache is not None else None for key in keys]
        missing = [k for k, answer in enumerate(found) if answer is None]
        states = [chunk[k]["text"] for k in missing]
        responses = _read_each(lambda some: engine.decide_many(some, asked, **raw), states)
        for k, response in zip(missing, responses):
            if isinstance(response, INPUT_ERRORS):
                refused.append(_refusal(first + k, chunk[k]["text"], response))
                continue
            read = CachedAnswer(
                {qid: distribution(response.answers[qid]) for qid in asked},
                {qid: response.answers[qid].candidate_mass for qid in asked},
                None,
            )
            found[k] = read
            if cache is not None:
                cache.put(keys[k], read)
        reused += len(chunk) - len(missing)
        bar.update(len(chunk))
        for record, answer in zip(chunk, found):
            if answer is not None:  # None: refused
                _keep_question(answers, record, answer)
    bar.close()
    seconds = time.perf_counter() - started
    return Answers(None, answers, priors, seconds, reused, **_spent(engine, counted), refused=refused)


def _keep_question(answers: dict[str, FieldAnswers], record: dict[str, Any], answer: CachedAnswer) -> None:
    """Add one record's answer to every question it has a gold label for."""
    gold = {}
    for qid, out in answers.items():
        if qid not in record["labels"]:
            continue
        value = record["labels"][qid]
        name = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if name not in out.labels:
            raise PcdError(f"question {qid!r}: gold value {value!r} is not one of {list(out.labels)}")
        gold[qid] = out.labels.index(name)
    _keep(answers, record["text"], gold, answer, False, False)


def debias_rows(probabilities: np.ndarray, prior: tuple[float, ...]) -> np.ndarray:
    scaled = probabilities / np.maximum(np.asarray(prior), PRIOR_FLOOR)
    return scaled / scaled.sum(axis=1, keepdims=True)


def calibrate_rows(probabilities: np.ndarray, calibration: FieldCalibration) -> np.ndarray:
    scores = calibration.scores(np.log(np.maximum(probabilities, 1e-300)))
    scores -= scores.max(axis=1, keepdims=True)
    exp = np.exp(scores)
    return exp / exp.sum(axis=1, keepdims=True)


def variants(answers: Answers, name: str, calibration: Calibration | None) -> dict[str, np.ndarray]:
    """The probability rows of one field in each variant the report compares."""
    out = answers.fields[name]
    raw = out.array()
    rows = {"raw": raw, "debiased": debias_rows(raw, answers.priors[name])}
    found = calibration.for_field(name, out.labels) if calibration is not None else None
    if calibration is not None and found is not None:
        rows["calibrated"] = calibrate_rows(rows["debiased" if calibration.debiases(found) else "raw"], found)
    head = calibration.head_for(name, out.labels) if calibration is not None else None
    if head is not None and len(out.hidden) == len(out.gold):
        rows["head"] = head.probabilities(out.states())
    return rows


def fit_calibration(
    answers: Answers,
    *,
    debias: bool,
    bias: bool,
    model: str,
    fitted_on: Mapping[str, Any],
    bias_sd: float = BIAS_SD,
    top_label: bool = True,
) -> Calibration:
    """Per field, a temperature (and with ``bias``, per-label biases under a ``N(0, bias_sd**2)``
    prior) fitted on the raw or the debiased answers; with ``top_label``, then scaled to fit the
    confidence (pcd_core/trust/calibration_fitting.py).
    """
    fields = {}
    for name, out in answers.fields.items():
        if not out.gold:
            continue
        rows = variants(answers, name, None)["debiased" if debias else "raw"]
        logp = np.log(np.maximum(rows, 1e-300))
        temperature, biases = fit(logp, out.gold, bias=bias, bias_sd=bias_sd, top_label=top_label)
        fields[name] = FieldCalibration(out.labels, temperature, biases)
    return Calibration(model, debias, fields, dict(fitted_on), bias_sd if bias else None)


def _pooled(per_field: dict[str, dict[str, np.ndarray]], answers: Answers, variant: str) -> dict[str, float]:
    """Every decision of every field as one set: rows padded with zero columns to the widest field,
    which changes no metric; macro-F1 is the mean of the fields' own.
    """
    names = [n for n in per_field if variant in per_field[n] and len(answers.fields[n].gold)]
    width = max(len(answers.fields[n].labels) for n in names)
    rows = np.concatenate(
        [np.pad(per_field[n][variant], ((0, 0), (0, width - per_field[n][variant].shape[1]))) for n in names]
    )
    gold = np.concatenate([answers.fields[n].gold for n in names])
    mass = np.concatenate([answers.fields[n].candidate_mass for n in names])
    pooled = metrics.summarise(rows, gold, mass)
    pooled["macro_f1"] = float(
        np.mean(
            [
                metrics.macro_f1(
                    metrics.predictions(per_field[n][variant]), answers.fields[n].gold, per_field[n][variant].shape[1]
                )
                for n in names
            ]
        )
    )
    return pooled


def build_report(answers: Answers, calibration: Calibration | None = None) -> dict[str, Any]:
    """Per field and overall: the metrics of every variant, and the AR-constrained accuracy."""
    per_field = {name: variants(answers, name, calibration) for name in answers.fields}
    report: dict[str, Any] = {"fields": {}, "overall": {}}
    for name, rows in per_field.items():
        out = answers.fields[name]
        if not out.gold:
            continue
        entry: dict[str, Any] = {v: metrics.summarise(r, out.gold, out.candidate_mass) for v, r in rows.items()}
        if out.constrained_ar:
            n_ar = len(out.constrained_ar)
            entry["constrained_ar"] = {
                "n": float(n_ar),
                "accuracy": metrics.accuracy(out.constrained_ar, out.gold[:n_ar]),
                "pcd_accuracy_same_examples": metrics.accuracy(
                    metrics.predictions(rows["raw"][:n_ar]), out.gold[:n_ar]
                ),
            }
        entry["prior"] = dict(zip(out.labels, answers.priors[name]))
        report["fields"][name] = entry
    for variant in ("raw", "debiased", "calibrated", "head"):
        if any(variant in rows for rows in per_field.values()):
            report["overall"][variant] = _pooled(per_field, answers, variant)
    ar = [(a, g) for out in answers.fields.values() for a, g in zip(out.constrained_ar, out.gold)]
    if ar:
        # the baseline may have read only the first examples: PCD's accuracy on those same ones beside it
        pcd = [
            int(np.argmax(row)) == g
            for out in answers.fields.values()
            for row, g in zip(out.probabilities[: len(out.constrained_ar)], out.gold)
        ]
        report["overall"]["constrained_ar"] = {
            "n": float(len(ar)),
            "accuracy": float(np.mean([a == g for a, g in ar])),
            "pcd_accuracy_same_examples": float(np.mean(pcd)),
        }
    report["seconds"] = round(answers.seconds, 1)
    report["reused_answers"] = answers.reused
    report["forward_passes"] = answers.forward_passes
    report["tokens_read"] = answers.tokens_read
    report["refused"] = answers.refused
    return report

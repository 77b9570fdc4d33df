"""lm-evaluation-harness model ``syncdrop``: any syncdrop model at any TP degree and sync plan.

Registration. lm-eval 0.4.13 finds models only in its registry (``@register_model`` or
``model_registry.register(name, target="module:Class")``); it fills that registry from its own
``lm_eval.models`` mapping and scans no entry points, so no installed package can add a model to
the stock ``lm_eval`` command by being installed. Importing this module registers ``syncdrop``; the
console script ``syncdrop-lm-eval`` (:func:`syncdrop.eval.cli.lm_eval_main`) imports it and then
runs lm-eval's own CLI, so ``syncdrop-lm-eval --model syncdrop --model_args model=smollm2,tp=3,plan=all
--tasks ...`` is the stock command with the model added. From Python, ``import syncdrop.eval.harness``
before ``lm_eval.simple_evaluate(model="syncdrop", ...)``, or pass a :class:`SyncdropLM` instance.

Model args: ``model`` (spec as for ``--model``), ``tp``, ``plan`` (spec; inside comma-separated
``--model_args`` write ``blocks:0;3;7`` or use the JSON form), ``dtype``, ``executor``, ``device``
(``auto | cpu | cuda | cuda:N``; lm-eval's own ``--device`` lands here too), ``backend`` (``auto | gloo
| nccl``, distributed runtime only), ``drop_variant``, ``max_length``, ``max_gen_toks``, ``batch_size``,
``dist_timeout``, ``exact_reduce``. The model is built by :func:`syncdrop.runtime.choose_runtime` and
:meth:`~syncdrop.runtime.Runtime.build`, as every syncdrop command builds its models.

Devices: requests are tokenized on the host; each batch's token ids go to the model's device, the
log-probabilities are gathered there, and one copy per batch brings them back for the per-request
sums. Generation keeps its tokens and sampling generator on the device and reads back one token id
per step (stop strings are checked on the host).

Conventions (those of lm-eval's ``hf`` model, :class:`lm_eval.models.huggingface.HFLM`, so scores
match it): a (context, continuation) pair is tokenized as ``enc(context + continuation)`` split
after ``len(enc(context))`` tokens, trailing spaces of the context moved to the continuation
(:meth:`lm_eval.api.model.TemplateLM._encode_pair`); the tokenizer's default special tokens; an empty
context becomes the BOS token (EOS if the tokenizer has none); inputs longer than ``max_length``
(default: the model's positions) are cut from the left; requests sharing ``context +
continuation[:-1]`` share one forward row (multiple-choice answers of one token); log-probabilities
are float32 ``log_softmax`` of the logits at the continuation positions. Rolling log-likelihoods use
lm-eval's windows (``get_rolling_token_windows``, BOS prefix, context 1).

Batching: requests are sorted by length (longest first) and ``batch_size`` rows are right-padded
to one forward; causal attention makes padding invisible to the positions that are scored.

Tensor parallelism: ranks are *tensor*-parallel, so every process must run the same forwards (each
contains collectives). lm-eval's own ``rank`` / ``world_size`` mean data parallelism; this class
reports rank 0 of 1 on every process so lm-eval hands each process all requests, in the same order.
lm-eval 0.4.13 returns results only where ``LOCAL_RANK`` is 0; :attr:`is_main` says where to print.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from syncdrop.errors import SyncdropError
from syncdrop.progress import progress_bar

log = logging.getLogger(__name__)

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings for the cache, context ids, cont ids)
SCORE_CHUNK = 2048  # positions per log_softmax (bounds the (positions, vocab) float32 buffer)
DEFAULT_BATCH_SIZE = 8


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _int_arg(value: Any, name: str, default: int) -> int:
    if value is None or value == "":
        return default
    if isinstance(value, str) and value.startswith("auto"):
        log.warning("%s=%s is not supported; using %d", name, value, default)
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise SyncdropError(f"{name} must be an integer, got {value!r}") from None
    if n < 1:
        raise SyncdropError(f"{name} must be at least 1, got {n}")
    return n


@register_model("syncdrop")
class SyncdropLM(TemplateLM):
    """lm-eval ``LM`` over a :class:`syncdrop.runtime.Built` model (or one built from the args)."""

    def __init__(self, model: str = "smollm2", tp: int = 1, plan: str | None = None, dtype: str = "float32",
                 executor: str = "auto", drop_variant: str = "drop", batch_size: int | str | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, dist_timeout: float = 60.0,
                 exact_reduce: bool = False, progress: bool = True, built: Any = None, device: str | None = "auto",
                 backend: str | None = "auto", **unused: Any) -> None:
        super().__init__()
        for k, v in unused.items():
            if v is not None and k != "max_batch_size":
                log.warning("syncdrop model: ignoring unknown argument %s=%r", k, v)
        if built is None:
            from syncdrop.runtime import choose_runtime

            plan = None if plan is None else str(plan).replace(";", ",")
            runtime = choose_runtime(str(executor), str(device or "auto"), str(backend or "auto"), str(dtype),
                                     exact_reduce=bool(exact_reduce), dist_timeout=float(dist_timeout))
            built = runtime.build(str(model), _int_arg(tp, "tp", 1), plan, str(drop_variant), progress=progress)
        self.built = built
        self.lm = built.model
        self.tokenizer = built.source.load_tokenizer()
        self.batch_size = _int_arg(batch_size, "batch_size", DEFAULT_BATCH_SIZE)
        cfg = built.source.config
        self._max_length = _int_arg(max_length, "max_length", cfg.sliding_window or cfg.max_positions)
        self._max_gen_toks = _int_arg(max_gen_toks, "max_gen_toks", 256)
        self.progress = progress
        self.logits_cache = True
        self.forwards = 0  # model forwards run (rows are batched into one forward)

    # ---------------------------------------------------------------- properties lm-eval reads
    @property
    def is_main(self) -> bool:
        return self.built.is_main

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        b = self.built
        return {"syncdrop_model": b.source.name, "tp": b.model.layout.tp if hasattr(b.model, "layout") else 1,
                "plan": b.plan.summary(), "runtime": "distributed" if b.dist else "single-process"}

    # ---------------------------------------------------------------- tokenization
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """As HFLM: the tokenizer's default special tokens, none if ``string`` starts with BOS."""
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kw["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **kw)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), continuation is the greedy choice) per request."""
        groups: dict[Any, list[int]] = defaultdict(list)  # model input -> requests scored on it
        for i, (_, ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise ValueError(f"request {i}: empty context or continuation tokens")
            if len(cont) > self.max_length:
                raise SyncdropError(f"a continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            full = ctx + cont
            groups[tuple(full[:-1]) if self.logits_cache else i].append(i)
        rows = []  # (input ids, [(request, its continuation tokens)])
        for members in groups.values():
            ctx, cont = requests[members[0]][1], requests[members[0]][2]
            inp = (ctx + cont)[-(self.max_length + 1):][:-1]
            rows.append((inp, [(m, requests[m][2]) for m in members]))
        rows.sort(key=lambda r: (-len(r[0]), r[0]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = progress_bar(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self._show_progress())
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            for (m, _), res in zip((x for _, ms in batch for x in ms), self._score_batch(batch), strict=True):
                results[m] = res
                s = requests[m][0]
                if s is not None:
                    self.cache_hook.add_partial("loglikelihood", s, res)
            bar.update(sum(len(ms) for _, ms in batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _show_progress(self) -> bool:
        return self.progress and self.is_main

    @torch.inference_mode()
    def _score_batch(self, batch: list[tuple[list[int], list[tuple[int, list[int]]]]]) -> list[tuple[float, bool]]:
        """One forward over right-padded rows; each member's continuation is scored at the last
        ``len(cont)`` positions of its row (for the target tokens, the input shifted by one)."""
        width = len(batch[0][0])
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # built on the host, moved by the model
        for r, (inp, _) in enumerate(batch):
            ids[r, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        hidden = self.lm.hidden_states(ids)  # (B, S, h) on the model's device
        self.forwards += 1
        # positions needed per row: the longest continuation among its members
        sel, pos, tok, owner = [], [], [], []
        n = k = 0  # positions selected so far, requests so far
        for r, (inp, members) in enumerate(batch):
            c = max(len(cont) for _, cont in members)  # <= len(inp): contexts are never empty
            sel.append(hidden[r, len(inp) - c : len(inp)])
            for _, cont in members:
                pos += range(n + c - len(cont), n + c)
                tok += cont
                owner += [k] * len(cont)
                k += 1
            n += c
        h = torch.cat(sel)  # (n, h)
        dev = h.device
        pos_t, tok_t = torch.tensor(pos, device=dev), torch.tensor(tok, device=dev)  # (P,): scored positions
        logp = torch.empty(len(pos), dtype=torch.float64, device=dev)
        greedy = torch.empty(len(pos), dtype=torch.bool, device=dev)
        for s in range(0, n, SCORE_CHUNK):
            lp = F.log_softmax(self.lm.logits(h[s : s + SCORE_CHUNK]).float(), dim=-1)  # (chunk, V)
            m = (pos_t >= s) & (pos_t < s + SCORE_CHUNK)
            p = pos_t[m] - s
            logp[m] = lp[p, tok_t[m]].double()
            greedy[m] = lp[p].argmax(-1) == tok_t[m]
        logp, greedy = logp.cpu(), greedy.cpu()  # one copy to the host per batch; the sums below are there
        owner_t = torch.tensor(owner)
        return [(float(logp[owner_t == i].sum()), bool(greedy[owner_t == i].all())) for i in range(k)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string: lm-eval's disjoint windows of ``max_length``
        predictions, the first conditioned on the BOS prefix, each later one on the token before it."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows: list[Request] = []
        owners: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm), strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """One request at a time (prompts of unequal length are not batched), with a KV cache:
        greedy unless ``do_sample``; stops at EOS, at any ``until`` string, or after ``max_gen_toks``
        tokens; the text is cut before the first stop string (as HFLM). In the distributed runtime
        every rank continues with rank 0's token, so all ranks stop together."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        if not hasattr(self.lm, "new_cache"):
            raise SyncdropError("generate_until needs a syncdrop executor (not --executor hf)")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out = []
        for req in progress_bar(requests, desc="generate_until", disable=disable_tqdm or not self._show_progress()):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise SyncdropError(f"max_gen_toks {max_new} must be below max_length {self.max_length}")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            tokens = self._generate_one(ids, max_new, until, kwargs)
            text = postprocess_generated_text(self.tok_decode(tokens), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    @torch.inference_mode()
    def _generate_one(self, ids: list[int], max_new: int, until: list[str], kwargs: dict[str, Any]) -> list[int]:
        from syncdrop.generate import SamplingParams, sample_next, sampling_generator

        params = SamplingParams(temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"), seed=int(kwargs.get("seed", 0)))
        params.validate()
        device = self.lm.device
        gen = sampling_generator(device, params.seed)
        comm = getattr(self.built, "comm", None)  # None: transformers' model (one process)
        agree = comm.broadcast if comm is not None else _same  # every rank continues with rank 0's token
        cache = self.lm.new_cache(1, len(ids) + max_new)
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        h = self.lm.hidden_states(prompt, cache, 0)[:, -1]
        new: list[int] = []
        stops = [s for s in until if s]
        while True:
            nxt = agree(sample_next(self.lm.logits(h), params, gen))  # (1,) on the device
            new.append(int(nxt[0]))  # the one host read per step: EOS and stop strings are checked here
            if new[-1] == self.eot_token_id or len(new) >= max_new:
                break
            text = self.tok_decode(new, skip_special_tokens=False)
            if any(s in text for s in stops):
                break
            h = self.lm.hidden_states(nxt[:, None], cache, len(ids) + len(new) - 1)[:, -1]
        return new

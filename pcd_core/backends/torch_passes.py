"""The torch backend's model and the one decoder pass that every read of it is made of.

``TorchPasses`` holds a ``transformers`` causal LM and its shape (layers, attention types, window,
soft-capping, the sizes a pass's memory estimate reads), and the parts every read shares: the
cache over a prefix's tensors (``torch_cache.py``), one decoder forward that also sums the middle
layers' outputs, the additive attention masks, the output head, and prefill. The reads built on it
are functions over it in their own modules: packed rows (``torch_packed.py``), batches of groups
and of copies (``torch_batched.py``), generation (``torch_generation.py``); ``TorchBackend``
(``torch_backend.py``) puts them together behind the backend contract.

Under a cancelled caller a pass stops between decoder layers (``_decode``, ``pass_stop.py``).

The masks are what SDPA's memory-efficient kernel takes: additive, in the model's dtype, one copy
shared by every head (transformers repeats the key/value heads itself when a mask is given), the key
dimension padded to a multiple of 16 elements and passed as a view (``MASK_ALIGN``), so that no layer
pads a copy of its own. Models with sliding-window layers (Gemma 3) get a second mask with the
window applied. The same masks, views included, are what CPU runs and what the tests check; whether
CUDA picks that kernel rather than the math one is not checked here (no GPU): ``examples/gpu_check.sh``
times it. Every prefill ends with a device synchronisation (``synchronize``), so that timings taken
around backend calls count the GPU's work, not only its queueing. The torch backend's modules
reach this one only through ``torch_backend``, which checks that torch is installed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch  # reached only through ``torch_backend``, which checks that torch is there
from transformers.cache_utils import Cache

from pcd_core.backends.base import Backend, Prefix, cut_states, middle_layers
from pcd_core.backends.pass_stop import StopSignal, stop_inside, watched
from pcd_core.backends.torch_cache import PrefixLayer, Room, StemMemo, TorchState

#: the key dimension of every additive mask is padded to this many elements, and the mask passed as a
#: view: the memory-efficient kernel wants each row of a bias to start 16 bytes apart (8 bfloat16s,
#: 4 float32s) and pads a copy per layer otherwise; 16 elements covers every dtype offered
MASK_ALIGN = 16


def _check_before(signal: StopSignal, layer: int, n_layers: int, _module: Any, _args: Any) -> None:
    """A decoder layer's forward pre-hook: stop the pass here once its caller is cancelled."""
    stop_inside(signal, layer, n_layers)


class TorchPasses(Backend):
    """A ``transformers`` causal LM, and one pass over it after a prefix; ``TorchBackend`` reads on it."""

    def __init__(self, model: Any, *, max_tokens_per_pass: int | None = None) -> None:
        config = model.config
        context = getattr(config, "max_position_embeddings", None) or 2048
        super().__init__(context_length=int(context), max_tokens_per_pass=max_tokens_per_pass)
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.n_layers = int(config.num_hidden_layers)
        self._middle = middle_layers(self.n_layers)
        self.layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * self.n_layers)
        self.window = getattr(config, "sliding_window", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self._vocab = int(self.head.weight.shape[0])
        dtype = next(model.parameters()).dtype
        n_kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        element = torch.finfo(dtype).bits // 8
        self.kv_bytes_per_token = 2 * self.n_layers * n_kv * head_dim * element
        # the boolean mask, its additive copy in the model's dtype, and the tree's numpy ancestors
        self.mask_bytes_per_entry = 2 + element
        self._stems: StemMemo | None = None  # the last batch of groups' requests (``torch_batched.py``)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def compute_dtype(self) -> str:  # type: ignore[override]
        return self.placement["dtype"]

    @property
    def placement(self) -> dict[str, str]:
        """Where the model computes and in what, for benchmark records: ``{"device", "dtype"}``."""
        dtype = next(self.model.parameters()).dtype
        return {"device": str(self.device), "dtype": str(dtype).removeprefix("torch.")}

    # -- one pass -----------------------------------------------------------------------------
    def _cache(self, prefix: Prefix | None, keep: int | None, room: int = 0, record: bool = False) -> Cache:
        if prefix is None:
            return Cache(layers=[PrefixLayer(None, None, keep, room) for _ in range(self.n_layers)])
        state: TorchState = prefix.state
        return Cache(layers=[PrefixLayer(k, v, keep, room, record) for k, v in zip(state.keys, state.values)])

    def _decode(self, **inputs: Any) -> tuple[Any, torch.Tensor]:
        """One decoder forward, and the mean of the middle layers' outputs at every position
        (``middle_layers`` in base.py), summed as each layer finishes so no layer's output is kept.
        Under a caller's cancellation that this pass serves alone (``pass_stop.watched``), each layer
        first checks it and raises ``Cancelled`` once it is set: a long pass stops inside, and what it
        wrote goes with its frames (``pass_stop.py`` says why nothing shared is left half-written).
        """
        total: list[torch.Tensor] = []

        def add(_module: Any, _args: Any, output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            total.append(state if not total else total.pop() + state)

        hooks = [self.decoder.layers[i].register_forward_hook(add) for i in self._middle]
        signal = watched()
        if signal is not None:
            hooks += [
                layer.register_forward_pre_hook(partial(_check_before, signal, i, self.n_layers))
                for i, layer in enumerate(self.decoder.layers)
            ]
        try:
            out = self.decoder(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        return out, total[0] / len(self._middle)

    @staticmethod
    def _kept(
        cache: Cache,
        last_hidden: torch.Tensor,
        last_middle: torch.Tensor,
        trunk_states: tuple[int, torch.Tensor, torch.Tensor] | None = None,
    ) -> TorchState:
        layers = [layer for layer in cache.layers if isinstance(layer, PrefixLayer)]
        assert len(layers) == len(cache.layers), "every layer of the engine's caches is a PrefixLayer"
        keys = tuple(layer.keys for layer in layers if layer.keys is not None)
        values = tuple(layer.values for layer in layers if layer.values is not None)
        room = None
        buffers = [layer.buffers for layer in layers if layer.buffers is not None]
        if buffers and len(buffers) == len(layers):
            room = Room([k for k, _ in buffers], [v for _, v in buffers], keys[0].shape[-2])
        return TorchState(
            keys=keys,
            values=values,
            last_hidden=last_hidden.detach(),
            room=room,
            last_middle=last_middle.detach(),
            trunk_states=trunk_states,
        )

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix | None:
        """Views of the first ``n_tokens`` keys and values (no copy), when they end inside what the
        pass that made ``prefix`` read (its trunk, or a prefill's tokens), whose states it kept; else
        None (``cut`` reads again).
        """
        state: TorchState = prefix.state
        kept = cut_states(state.trunk_states, n_tokens)
        if kept is None:
            return None
        cut = TorchState(
            keys=tuple(k[..., :n_tokens, :] for k in state.keys),
            values=tuple(v[..., :n_tokens, :] for v in state.values),
            last_hidden=kept[1][-1],
            last_middle=kept[2][-1],
            trunk_states=kept,
        )
        return Prefix(ids=prefix.ids[:n_tokens], state=cut)

    def _masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor) -> Any:
        """Additive masks per attention type; ``allowed`` is [batch, q, k] before any window. Each is a
        [batch, 1, q, k] view of a buffer whose key dimension is padded to ``MASK_ALIGN``.
        """
        dtype = next(self.model.parameters()).dtype
        blocked = torch.finfo(dtype).min
        n_keys = allowed.shape[-1]
        width = -(-n_keys // MASK_ALIGN) * MASK_ALIGN

        def additive(ok: torch.Tensor) -> torch.Tensor:
            padded = torch.full((*ok.shape[:-1], width), blocked, dtype=dtype, device=ok.device)
            mask = padded[..., :n_keys]
            mask.masked_fill_(ok, 0.0)
            return mask[:, None]

        if "sliding_attention" not in self.layer_types:
            return additive(allowed)
        assert self.window is not None, "a model with sliding-window layers names its window"
        in_window = (q_pos[..., :, None] - k_pos[..., None, :]) < self.window
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> TorchState:
        start = parent.n_tokens if parent is not None else 0
        cache = self._cache(parent, keep=None, room=room)
        q_pos = torch.arange(start, start + len(ids), device=self.device)
        mask = None  # a read from the start: transformers runs SDPA's causal kernel without a mask
        if parent is not None:
            # after a prefix, transformers would hand SDPA a boolean mask, which SDPA turns into an
            # additive one in every layer; the additive one, made once, reads the same and is cheaper
            k_pos = torch.arange(start + len(ids), device=self.device)
            mask = self._masks(q_pos[None], k_pos[None], (k_pos[None, :] <= q_pos[:, None])[None])
        out, middle = self._decode(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=q_pos[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        hidden, middle = out.last_hidden_state[0], middle[0]
        state = self._kept(cache, hidden[-1], middle[-1], (start, hidden, middle))  # a cut may end inside
        self.synchronize()
        return state

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA runs asynchronously); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def device_memory_mark(self) -> int | None:
        """Bytes the CUDA allocator holds now, its peak counter reset to them; None off CUDA, where
        the process's RSS counts the model's memory.
        """
        if self.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def device_memory_peak(self) -> int:
        """The CUDA allocator's peak since ``device_memory_mark``."""
        return int(torch.cuda.max_memory_allocated(self.device))

    @torch.inference_mode()
    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        return self._logp(prefix.state.last_hidden[None])[0].double().cpu().numpy()

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        state: TorchState = prefix.state
        return torch.cat([state.last_hidden, state.last_middle]).float().cpu().numpy()

"""Background compilation, into JAX's persistent cache, of the programs a sampler will need next.

Once admissions came in three sizes, the prefill of every other admission size; and the decode of
every attention window its slots' requests can reach. Their first calls then read the cache
instead of stalling generation on a compile. Nothing runs without a persistent cache to fill."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from rlax_tasks.rollout.kernels import admission_arrays, fold_in_rows
from rlax_tasks.rollout.shapes import admission_sizes, decode_window, shared_prompt_rows

if TYPE_CHECKING:  # a cycle: the sampler owns its precompiler
    from rlax_tasks.rollout.sampler import Sampler

log = logging.getLogger(__name__)


class Precompiler:
    """Compiles a sampler's next programs on low-priority background threads (``threads``)."""

    def __init__(self, sampler: Sampler, enabled: bool = True) -> None:
        self.sampler = sampler
        self.enabled = enabled
        self.threads: list[threading.Thread] = []
        self._done: set[tuple] = set()  # (kind..., shape) compiled or under way
        # (bucket, filtering, sampling) -> {(rows, prompt rows)} admitted
        self._admissions_seen: dict[tuple, set[tuple[int, int | None]]] = {}
        self._rows_per_prompt = 1  # the most requests per distinct prompt an admission had
        self._stop = threading.Event()

    def admitted(
        self,
        rows: int,
        prompt_rows: int | None,
        bucket: int,
        filtering: bool,
        sampling: bool,
        rows_per_prompt: int = 1,
    ) -> None:
        """After an admission: once admissions at (bucket, filtering, sampling) came in three
        sizes, the prefill of every other size compiles, with the prompt rows its groups make
        likely. Two sizes compile nothing: a workload admitting whole batches often starts with
        two (its first requests trickle in), and would pay for programs it never runs."""
        self._rows_per_prompt = max(self._rows_per_prompt, rows_per_prompt)
        seen = self._admissions_seen.setdefault((bucket, filtering, sampling), set())
        seen.add((rows, prompt_rows))
        if len({n for n, _ in seen}) < 3:
            return
        sampler = self.sampler
        shapes = self._not_done(
            ("prefill", bucket, filtering, sampling),
            [
                (n, likely)
                for n in admission_sizes(sampler.max_slots)
                for likely in self._likely_prompt_rows(n)
                if (n, likely) not in seen
            ],
        )
        if not shapes:
            return
        args = self._abstract_state()

        def lower(n: int, prompt_rows: int | None) -> list[Any]:
            cfg, graphdef = sampler.policy.config, sampler.policy.graphdef
            ids, lengths, source, slots, new = admission_arrays(
                n, bucket, prompt_rows, sampler.max_slots, sampler.max_stop_ids
            )
            static = (filtering, sampling, sampler.support_size(filtering))
            rows = (ids, lengths, source, slots, new)
            prefill = sampler._prefill_fn.lower(cfg, graphdef, *args, *rows, *static)
            seeds, indices = np.zeros((n, 2), np.uint32), np.zeros(n, np.uint32)
            return [prefill, fold_in_rows.lower(seeds, indices)]

        what = f"admissions of (rows, prompt rows) {shapes} at prompt bucket {bucket}"
        self._start(what, [functools.partial(lower, *shape) for shape in shapes])

    def decoding(self, window: int, reach: int, filtering: bool, sampling: bool) -> None:
        """Before a decode chunk at ``window``: the windows past it that the slots' requests will
        reach (``reach``: their longest prompt + max_new_tokens) compile in the background."""
        max_len = self.sampler.max_len
        windows, w = [], window
        while w < decode_window(reach, max_len):
            w = decode_window(w + 1, max_len)
            windows.append(w)
        self._done.add(("decode", filtering, sampling, window))  # compiles now, in the foreground
        windows = self._not_done(("decode", filtering, sampling), windows)
        if not windows:
            return
        args = self._abstract_state()
        refill = np.bool_(False)
        sampler = self.sampler
        static, support = (filtering, sampling), sampler.support_size(filtering)

        def lower(w: int) -> list[Any]:
            graphdef, chunk = sampler.policy.graphdef, sampler.decode_chunk
            return [sampler._decode_fn.lower(graphdef, *args, chunk, *static, w, refill, support,
                                             sampler.route_shape)]

        self._start(f"decode windows {windows}", [functools.partial(lower, w) for w in windows])

    def stop(self) -> None:
        """Background compilations end after the one under way (a worker that stops)."""
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Waits for the background compilations started so far (tests, benchmarks)."""
        for thread in self.threads:
            thread.join(timeout_s)

    def _likely_prompt_rows(self, rows: int) -> list[int | None]:
        """The prompt rows an admission of ``rows`` is likely to come with: every row its own
        prompt, and, once admissions shared prompts (groups of G), whole groups or one more
        (a group split between two admissions)."""
        out: list[int | None] = [None]
        g = self._rows_per_prompt
        if g > 1:
            whole_groups = -(-rows // g)
            for distinct in (whole_groups, whole_groups + 1):
                prompt_rows = shared_prompt_rows(rows, distinct, self.sampler.max_slots)
                if prompt_rows not in out:
                    out.append(prompt_rows)
        return out

    def _not_done(self, kind: tuple, shapes: list[Any]) -> list[Any]:
        """Those of ``shapes`` (of programs ``kind``) to compile now, marked as done: none
        without a persistent cache to fill."""
        if not self.enabled or not jax.config.jax_compilation_cache_dir:
            return []
        todo = [n for n in shapes if (*kind, n) not in self._done]
        self._done.update((*kind, n) for n in todo)
        return todo

    def _abstract_state(self) -> tuple[Any, Any, Any, Any]:
        """(params, held copies, cache, slot state) as shapes with their placements: what a
        background lowering reads while generation goes on with (and donates) the arrays."""

        def spec(a: jax.Array) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        s = self.sampler
        return jax.tree.map(spec, (s.policy.params, s._held, s._cache, s._state))

    def _start(self, what: str, lowerings: list[Callable[[], list[Any]]]) -> None:
        scope = self.sampler.policy._scope
        stop = self._stop

        def run() -> None:
            t0 = time.perf_counter()
            with contextlib.suppress(OSError, AttributeError):  # Linux: this thread only
                # the lowest CPU priority: generation and training go first, the compilations
                # fill the cores' idle time
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                for lower in lowerings:
                    if stop.is_set() or not threading.main_thread().is_alive():
                        log.debug("precompiling %s: stopped", what)
                        return
                    with scope():
                        for lowered in lower():
                            lowered.compile()
            except Exception:  # a failure here only costs the compile later, in the foreground
                log.warning("precompiling %s failed", what, exc_info=True)
                return
            log.info("precompiled %s in %.1fs", what, time.perf_counter() - t0)

        # not a daemon: a daemon thread inside XLA's compiler when the interpreter exits aborts
        # the process (exit 134). The exit waits for the compilation under way, then the thread
        # stops (the main thread is no longer alive), as it does after stop().
        thread = threading.Thread(target=run, name="sampler-precompile", daemon=False)
        self.threads.append(thread)
        thread.start()

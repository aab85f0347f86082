"""A session's step on the server: validated from its frame, cut into slices when long, and run alone or
in one forward with other sessions' steps, all-or-nothing on the caches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitllm.protocol import wire
from splitllm.model.stage import Stage, StepInput
from splitllm.server.logs import event, log, session_tag
from splitllm.server.metrics import ServerMetrics
from splitllm.server.sessions import Session
from splitllm.server.settings import ServerSettings
from splitllm.model.visibility import Visibility
from splitllm.protocol.wire import ProtocolError


@dataclass
class PreparedStep:
    """A validated step request, ready to run alone or in a batch with other sessions' steps.

    A step longer than `slice_above` (a prompt) runs as forwards of `slice_rows` (`parts`, cut where the result stays
    exact), one per turn, so other sessions' steps run in between: a long prompt delays everyone
    else by one slice at a time, not by its whole length.
    """

    session: Session
    request_id: Any
    step: StepInput
    parts: list[tuple[int, int]]
    done: int = 0  # parts run so far
    outs: list[torch.Tensor] = field(default_factory=list)
    rollback: Callable[[], None] = lambda: None  # back to the cache before the first part
    compute_s: float = 0.0

    def next_input(self) -> StepInput:
        """The next part as a step of its own: it commits the whole previous part."""
        s = self.step
        if len(self.parts) == 1:
            return s
        (a, b), keep = self.parts[self.done], s.keep
        if self.done:
            prev = self.parts[self.done - 1]
            keep = list(range(prev[1] - prev[0]))
        return StepInput(s.cache, s.hidden[a:b], s.positions[a:b], s.vis.part(a, b), keep)

    def rows(self) -> int:
        a, b = self.parts[self.done]
        return b - a


class StepRunner:
    """Turns step frames into `PreparedStep`s and runs them through the stage, one forward per call."""

    def __init__(self, stage: Stage, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.stage, self.settings, self.metrics = stage, settings, metrics

    def prepare(self, session: Session, frame: wire.Frame) -> PreparedStep:
        """Validate a step frame of `session` against the stage; nothing is mutated yet."""
        h = frame.header
        hidden = frame.tensor
        if hidden is None:
            raise ProtocolError("bad_shape", "a step carries hidden states")
        if h["dtype"] != session.wire_dtype:
            raise ProtocolError("bad_dtype", f"session uses {session.wire_dtype} on the wire, got {h['dtype']}")
        n, width = hidden.shape
        if width != self.stage.cfg.hidden_size:
            raise ProtocolError("bad_shape", f"hidden size must be {self.stage.cfg.hidden_size}, got {width}")
        if n > self.settings.max_nodes_per_step:
            raise ProtocolError("too_many_nodes", f"at most {self.settings.max_nodes_per_step} positions per step")
        positions = h.get("positions")
        if not isinstance(positions, list) or len(positions) != n or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in positions
        ):
            raise ProtocolError("bad_positions", f"positions must be a list of {n} integers")
        keep = h.get("keep", [])
        if not isinstance(keep, list):
            raise ProtocolError("bad_keep", "keep must be a list of indices")
        if not bool(torch.isfinite(hidden).all()):
            raise ProtocolError("bad_values", "hidden states contain NaN or Inf")
        try:
            vis = Visibility.from_wire(h, n)
            step = StepInput(session.cache, hidden.to(self.settings.dtype), torch.tensor(positions, dtype=torch.long), vis, keep)
            self.stage.check_step(step.cache, step.hidden, step.positions, step.vis, step.keep)
        except (ValueError, OverflowError, RuntimeError) as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        parts = [(0, n)] if n <= self.settings.slice_above else vis.cuts(self.settings.slice_rows)
        return PreparedStep(session, h.get("id"), step, parts)

    def cost(self, prepared: PreparedStep) -> tuple[int, int]:
        """Rows and estimated transient bytes of a step: activations (the MLP's widest) and its masks."""
        cfg, step = self.stage.cfg, prepared.step
        n = prepared.rows()
        context = step.cache.length + len(step.keep) + prepared.parts[prepared.done][1]
        itemsize = torch.finfo(self.settings.dtype).bits // 8
        activations = n * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * itemsize
        masks = len(set(self.stage.windows)) * n * context * itemsize
        return n, activations + masks

    def run(self, prepared: list[PreparedStep]) -> list[bytes | None]:
        """Run the next part of validated steps (one session each) as one forward pass.

        A reply is None while a step has parts left. All-or-nothing on the caches: when a shared
        forward fails, every cache is restored and each step runs again alone, so the step that
        caused the failure gets the error (its cache as before the step) and the bystanders their
        exact results.
        """
        t0 = time.perf_counter()
        inputs = [p.next_input() for p in prepared]
        restores = [i.cache.checkpoint(i.keep) for i in inputs]
        for p, restore in zip(prepared, restores):
            if p.done == 0:
                p.rollback = restore
        try:
            outs = self.stage.forward_many(inputs)
        except Exception as exc:
            # The steps passed validation, so a failure here is the server's: its caches are restored
            # and the same step may be sent again.
            for restore in restores:
                restore()
            if len(prepared) > 1:
                log.warning("shared forward failed; its steps run again alone", extra={"fields": {"batch": len(prepared)}})
                return [reply for p in prepared for reply in self.run([p])]
            prepared[0].rollback()
            self.metrics.errors.labels("internal", prepared[0].session.principal).inc()
            log.exception("step failed mid-forward; cache restored")
            message = f"internal error: {type(exc).__name__}"
            return [wire.error_frame(prepared[0].request_id, "internal", message, retryable=True)]
        except BaseException:
            for p in prepared:
                p.rollback()
            raise
        elapsed = time.perf_counter() - t0
        self.metrics.step_seconds.observe(elapsed)
        self.metrics.batch_size.observe(len(prepared))
        replies: list[bytes | None] = []
        for p, part_out in zip(prepared, outs):
            p.outs.append(part_out)
            p.done += 1
            p.compute_s += elapsed
            if p.done < len(p.parts):
                replies.append(None)
                continue
            if len(p.parts) > 1:
                p.step.cache.reopen(p.parts[-1][0])  # as if one forward had run the whole step
            out = torch.cat(p.outs) if len(p.outs) > 1 else part_out
            p.session.steps += 1
            n = out.shape[0]
            self.metrics.steps.labels(p.session.principal).inc()
            self.metrics.step_nodes.labels(p.session.principal).inc(n)
            event(
                "step", logging.DEBUG, session=session_tag(p.session.id), nodes=n, keep=len(p.step.keep),
                batch=len(prepared), ms=p.compute_s * 1000,
            )
            header = {"op": "result", "id": p.request_id, "server_ms": p.compute_s * 1000}
            replies.append(wire.encode(header, out, p.session.wire_dtype))
        return replies

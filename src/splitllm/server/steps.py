"""A session's step on the server: checked against the session and the model, cut into slices when
long, and run alone or in one forward with other sessions' steps, all-or-nothing on the caches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitllm.protocol import messages
from splitllm.protocol.messages import ErrorMessage, RequestId, ResultMessage, StepMessage
from splitllm.model.stage import Stage, Step
from splitllm.server.logs import event, log, session_tag
from splitllm.server.metrics import ServerMetrics
from splitllm.server.sessions import Session
from splitllm.server.settings import ServerSettings
from splitllm.model.visibility import Visibility
from splitllm.protocol.wire import ProtocolError


@dataclass
class PreparedStep:
    """A checked step request, ready to run alone or in a batch with other sessions' steps.

    A step longer than `slice_above` (a prompt) runs as forwards of `slice_rows` (`parts`, cut where the result stays
    exact), one per turn, so other sessions' steps run in between: a long prompt delays everyone
    else by one slice at a time, not by its whole length.
    """

    session: Session
    request_id: RequestId
    step: Step  # its hidden states in the server's compute dtype
    parts: list[tuple[int, int]]
    done: int = 0  # parts run so far
    outs: list[torch.Tensor] = field(default_factory=list)
    rollback: Callable[[], None] = lambda: None  # back to the cache before the first part
    compute_s: float = 0.0

    def next_step(self) -> Step:
        """The next part as a step of its own: it commits the whole previous part."""
        if len(self.parts) == 1:
            return self.step
        (a, b), keep = self.parts[self.done], self.step.keep
        if self.done:
            prev = self.parts[self.done - 1]
            keep = tuple(range(prev[1] - prev[0]))
        return self.step.part(a, b, keep)

    def rows(self) -> int:
        a, b = self.parts[self.done]
        return b - a


class StepRunner:
    """Turns step messages into `PreparedStep`s and runs them through the stage, one forward per call."""

    def __init__(self, stage: Stage, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.stage, self.settings, self.metrics = stage, settings, metrics

    def prepare(self, session: Session, request: StepMessage) -> PreparedStep:
        """Check a step of `session` (its message checked on receipt) against the session and the stage;
        nothing is mutated yet. The visibility is unpacked only once the step's size is bounded."""
        hidden = request.hidden
        if request.dtype != session.wire_dtype:
            raise ProtocolError("bad_dtype", f"session uses {session.wire_dtype} on the wire, got {request.dtype}")
        n, width = hidden.shape
        if width != self.stage.cfg.hidden_size:
            raise ProtocolError("bad_shape", f"hidden size must be {self.stage.cfg.hidden_size}, got {width}")
        if n > self.settings.max_nodes_per_step:
            raise ProtocolError("too_many_nodes", f"at most {self.settings.max_nodes_per_step} positions per step")
        try:
            vis = Visibility.from_wire(request.parents, request.bits, n)
            positions = torch.tensor(request.positions, dtype=torch.long)
            step = Step(hidden.to(self.stage.dtype), positions, vis, request.keep, request.crop)
            self.stage.check_step(session.cache, step)
        except ValueError as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        parts = [(0, n)] if n <= self.settings.slice_above else vis.cuts(self.settings.slice_rows)
        return PreparedStep(session, request.id, step, parts)

    def cost(self, prepared: PreparedStep) -> tuple[int, int]:
        """Rows and estimated transient bytes of a step: activations (the MLP's widest) and its masks."""
        cfg, cache = self.stage.cfg, prepared.session.cache
        n = prepared.rows()
        base = cache.length if prepared.done or prepared.step.crop is None else prepared.step.crop
        context = base + len(prepared.step.keep) + prepared.parts[prepared.done][1]
        itemsize = torch.finfo(self.stage.dtype).bits // 8
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
        batch = [(p.session.cache, p.next_step()) for p in prepared]
        restores = [cache.checkpoint(step.keep, step.crop) for cache, step in batch]
        for p, restore in zip(prepared, restores):
            if p.done == 0:
                p.rollback = restore
        try:
            outs = self.stage.forward_many(batch)
        except Exception as exc:
            # The steps passed validation, so a failure here is the server's: its caches are restored
            # and the same step may be sent again.
            for restore in restores:
                restore()
            if len(prepared) > 1:
                log.warning("shared forward failed; its steps run again alone",
                            extra={"fields": {"batch": len(prepared)}})
                return [reply for p in prepared for reply in self.run([p])]
            prepared[0].rollback()
            self.metrics.errors.labels("internal", prepared[0].session.principal).inc()
            log.exception("step failed mid-forward; cache restored")
            message = f"internal error: {type(exc).__name__}"
            return [messages.encode(ErrorMessage("internal", message, retryable=True, id=prepared[0].request_id))]
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
                p.session.cache.reopen(p.parts[-1][0])  # as if one forward had run the whole step
            out = torch.cat(p.outs) if len(p.outs) > 1 else part_out
            p.session.steps += 1
            n = out.shape[0]
            self.metrics.steps.labels(p.session.principal).inc()
            self.metrics.step_nodes.labels(p.session.principal).inc(n)
            event(
                "step", logging.DEBUG, session=session_tag(p.session.id), nodes=n, keep=len(p.step.keep),
                batch=len(prepared), ms=p.compute_s * 1000,
            )
            result = ResultMessage(out, p.session.wire_dtype, p.compute_s * 1000, p.request_id)
            replies.append(messages.encode(result))
        return replies

"""How much the hidden states a split client sends and receives reveal, under real attacks."""

from splitllm.privacy.audit import run_audit
from splitllm.privacy.config import AuditConfig

__all__ = ["AuditConfig", "run_audit"]

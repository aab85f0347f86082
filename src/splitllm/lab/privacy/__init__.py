"""How much the hidden states a split client sends and receives reveal, under real attacks
(`audit.run_audit` with an `audit_config.AuditConfig`)."""

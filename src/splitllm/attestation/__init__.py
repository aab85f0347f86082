"""The confidential server: SEV-SNP and TDX evidence, its verification against a policy, and the sealed channel
(docs/confidential.md)."""

"""The confidential server: SEV-SNP evidence, its verification against a policy, and the sealed channel
(docs/confidential.md)."""

"""The client's learned drafter: an EAGLE-style head over the client's own top-layer features."""

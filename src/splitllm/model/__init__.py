"""Decoder model pieces shared by client and server: config, weights, blocks, stages."""

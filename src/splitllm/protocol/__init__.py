"""What crosses the wire between client and server: typed messages and their frames."""

"""Distributed machinery: who owns which matrix, and the collectives that move them."""

from orthoptim.parallel.collectives import CommStats

__all__ = ["CommStats"]

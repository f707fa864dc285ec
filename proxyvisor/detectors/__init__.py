"""Seeing a stuck agent without a model call: the self-report token, receipts, the detectors and the steer policy.

Everything here is sans-IO (plain data in, decisions out; no trio, sockets or clocks); the trio shell that feeds
it is ``proxyvisor.proxy.supervise``.
"""

"""Basin's loopback stack and the end-to-end demo.

Process orchestration on top of every other package: a loopback PD stack (basin-emulate engines,
the real smg router, the Basin gateway) and `make demo` on it.

Modules, one job each:
  stack.py  start and stop the loopback stack, always cleaned up
  demo.py   the same sessions replayed through a surge without and with the gateway
"""


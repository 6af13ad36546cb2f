"""The training thread: what runs inside ``loss.backward()`` and ``optimizer.step()``.

The forward hooks (``forward``), the backward and step hooks and the recorder (``hooks``),
the step's records and values (``records``, ``values``), the step boundary, the step packet the training thread
hands over once per optimizer step (``packet``), the on-device reductions (``kernels``),
optimizer-state reads (``optimizer``), sharded and data-parallel reductions (``sharded``),
the GradScaler's view (``amp``) and layer discovery at attach (``layers``).

It does the minimum: launch small reductions, hand over a packet, never wait for the device.
May import: torch, its own modules, and the shared declarations at the top of the package
(``config``, ``metrics``, ``statistics``, ``errors``). Never the publisher side (``snapshot``,
``spikes``, ``history``, ``incidents``), the scrape side (``serve``), the clients or the
build-time generators (``alerting``): tests/test_layout.py checks it.
"""

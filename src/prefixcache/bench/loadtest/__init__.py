"""``prefixcache loadtest``: `prefixcache serve` started on loopback and driven by concurrent clients.

Each lane starts its own servers (``python -m prefixcache serve`` in a subprocess, :mod:`.served`) and stops them:

* the plain lane (:mod:`.batching`): micro-batched against ``--max-batch 1``, every answer checked against the
  sequential in-process result (:mod:`.reference`, :mod:`.judge`), the table and ``--json`` (:mod:`.report`);
  with ``--openai`` the classify route against the OpenAI-compatible chat route (:mod:`.openai_lane`);
* the soak (:mod:`.soak`): one server, three tasks, a pool budget that holds two, for a number of seconds;
* the mixed load (:mod:`.mixed`): extraction and classification clients at once;
* the peer (:mod:`.peer`): `prefixcache serve` against llama.cpp's ``llama-server`` (:mod:`.llama_server`);
* fairness (:mod:`.fairness`): one client floods, another's one-item requests are timed.

What each lane runs is a frozen settings object of :mod:`.options` (no torch there: the CLI reads its defaults).
"""

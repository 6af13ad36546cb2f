"""Incident bundles: what a rank writes when a run goes non-finite, and how it is read.

``recorder`` keeps the last steps on the publisher thread and writes a bundle at an
incident; ``bundle`` is the schema (building, bounding, writing atomically, reading and
checking an untrusted file); ``npz`` the container; ``report`` the text and HTML that
``gradmon incident`` prints and writes. See docs/incidents.md for the schema.
"""

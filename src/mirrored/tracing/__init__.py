"""Replica steps traced once and replayed (:func:`mirrored.function`)."""

"""Routing traces: record (:func:`record`), read (:func:`open_trace`), schema (:mod:`.schema`)."""

from moelab.trace.reader import RoutingTrace, open_trace
from moelab.trace.recorder import RecordConfig, TraceRecorder, record
from moelab.trace.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "RecordConfig", "RoutingTrace", "TraceRecorder", "open_trace", "record"]

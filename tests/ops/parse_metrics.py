#!/usr/bin/env python3
"""Reads a Prometheus text exposition from stdin with the reference parser
(prometheus_client) and prints its samples as JSON: [[name, labels, value], ...]. Exits
non-zero if the text does not parse."""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families

samples = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        samples.append([s.name, s.labels, s.value])
json.dump(samples, sys.stdout)

"""Test session setup: importable checkout, 8 fake CPU devices, fast compiles.

These variables must be set before jax is imported, which is why they live here.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
# Compile time dominates the tiny models of the tests.
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')

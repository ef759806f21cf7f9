"""Tests of the scripts/ the Makefile runs."""

"""Postgres: the system of record. All SQL of jobplane lives in this package."""

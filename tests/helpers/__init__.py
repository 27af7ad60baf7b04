"""What the test files share (no tests here): models, data, reference results, runners and runs,
and helpers for processes and binaries. A test file imports these, never another test file."""

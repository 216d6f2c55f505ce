"""Other inference engines that quill's benchmarks measure against (built separately)."""

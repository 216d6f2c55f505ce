"""quill router: one OpenAI-compatible endpoint in front of prefill and decode instances
(disaggregation), or of whole-request instances; it picks instances by load."""

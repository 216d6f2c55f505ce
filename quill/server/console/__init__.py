"""The serving console: a page `quill serve` serves at `/` and `/console`, live from the step
events the metrics see (state.py), its routes and sign-in (routes.py), and its static files
(static/: plain HTML, CSS and JavaScript, charts drawn as SVG by hand; no build step, no CDN).
"""

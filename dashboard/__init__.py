"""The dashboard's pages (Streamlit). ``app.py`` is the outline; each module here lays
out one page from what ``viz`` computes, and ``common.py`` holds what they share."""

"""Where run state lives: idle runs paged to disk and back (paging.py, page_file.py). The process heap is
whitney/heap.py (torch-free: the service tunes it too).
"""

"""Where run state lives: idle runs paged to disk and back (paging.py, page_file.py), the process heap
(allocator.py).
"""

"""(being written: registers nothing yet)"""

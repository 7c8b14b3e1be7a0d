"""compression"""

"""python -m specframe"""
from specframe.cli import main

main()

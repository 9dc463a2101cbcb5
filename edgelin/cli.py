import click

@click.group()
def main():
    """edgelin"""

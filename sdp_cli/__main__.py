from sdp_cli.cli.main import main

main()

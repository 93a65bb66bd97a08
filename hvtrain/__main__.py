from hvtrain.cli import main

main()

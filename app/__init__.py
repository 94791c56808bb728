"""Pure core of tokenrelay: settings, protocol models, the Decoder, chat templates, model cards.

Nothing here touches the network: app/ imports nothing from broker/, workers/ or web/.
"""

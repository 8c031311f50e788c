"""Plain English words for RULER's tasks (`long_context.ruler`): the NIAH word keys (`adjective-noun`,
as RULER draws them from its word lists) and the common-words task's words (all three lists).

RULER draws these from the `wonderwords` package's lists; this package ships its own, so the tasks
need nothing beyond the library. Every word is lowercase ASCII letters and appears once overall.
"""

ADJECTIVES = tuple("""
able absent acid active agile airy alert amber ample ancient angry antique anxious arctic ashen
awake bad bald bare basic bitter blank bleak blind blond blunt bold bony brave brief bright brisk
broad broken bumpy busy calm candid careful casual cheap cheerful chilly civil clean clear clever
close cloudy coarse cold comic cosy crisp crude cruel curly cute damp dark dear deep dense direct
dirty dizzy dry dull dusty eager early easy elder empty equal even exact faint fair false famous
fancy fast fatal fierce filthy final fine firm flat fluffy fond foolish formal fragile free fresh
frozen full funny fuzzy gentle giant glad global gloomy golden good grand gray great green grim
gross happy hard harsh hasty heavy hidden high hollow honest hot huge humble hungry icy idle
inner jolly juicy keen kind large late lazy lean legal level light little live lively local lone
long loose loud lovely loyal lucky lunar mad major mellow merry mild minor misty modern modest
moist muddy mute narrow nasty neat nervous new nice noble noisy normal novel odd old open orange
outer pale plain plump polite poor prime proud pure purple quick quiet rapid rare raw ready real
regal rich rigid ripe rough round royal rude rural rusty sacred sad safe salty sandy scarce secret
shaky sharp shiny short shy silent silky silly simple slim slow small smart smooth snowy soft
solar solid sour spare spicy stale steep sticky stiff still stormy strange strict strong sunny
super sweet swift tall tame tender thick thin tidy tight tiny tired total tough tragic tropical
true ugly unique upper urban usual vague vast violet vital vivid warm wary weak weary wet white
whole wicked wide wild windy wise witty wooden young zany
""".split())

NOUNS = tuple("""
acorn actor airport album alley anchor angle ankle answer apple apron arch arena army arrow atlas
attic author avenue badge bakery ball banana band bank barn barrel basket bath battery beach beard
bell belt bench berry bicycle blanket blossom board boat bone book boot bottle boulder bowl box
branch bread brick bridge broom brush bubble bucket budget bugle bundle butter button cabin cable
cake camera camp canal candle canoe canvas canyon captain card carpet carrot castle cattle cave
ceiling cellar chain chair chalk channel chapel cheese cherry chest chimney circle city clock cloud
coast coat coffee coin collar comet copper corner cottage cotton county cradle crate crayon creek
crown cup curtain cushion dagger dancer dawn desk diamond dinner doctor dolphin door dragon drawer
dream drum eagle earth engine envelope fabric factory falcon farm feather fence ferry field finger
flag flame flower flute fog forest fork fossil fountain fox frame garden gate ghost glass glove
goat grape grass guitar hammer harbor hat hawk helmet hill honey horse hotel island jacket jar
jewel journal jungle kettle key kitchen kite knife ladder lake lamp lantern lawn leaf lemon letter
library lion lizard lobster locket magnet map marble market meadow medal melon mirror monkey moon
mountain mouse museum needle nest net notebook oak ocean office olive onion orchard otter oven owl
paddle palace panda paper parrot pasta path peach pearl pebble pencil pepper piano pillow pilot
planet plate pocket pond potato puzzle quarry quilt rabbit radio rainbow raven ribbon river road
robot rocket roof rope rose saddle sail salad salmon sandal scarf school shadow shell ship shovel
signal silver sister skate sled slipper snake soap socket spider spoon square stable stamp statue
stone storm stove street sugar suitcase summit sunset swan sword table teacher temple tent thread
throne ticket tiger timber toast tomato tower tractor train tree trumpet tulip tunnel turtle
umbrella valley vase velvet village violin wagon wall walnut wave whale wheel whistle window wing
winter wizard wolf zebra
""".split())

VERBS = tuple("""
accept adapt admire advise agree allow amuse appear arrange arrive attach attend avoid bake
balance bathe beg begin behave belong bless blink boast boil borrow bounce breathe build bury
calculate carry carve cast catch celebrate change charge chase cheer chew choose clap climb collect
comb compare complain connect copy count cover crawl create cross cry dance decide deliver depend
describe design destroy develop dig discover divide drag draw drift drink drive earn eat embrace
enjoy enter escape examine exist expand explain explore fasten fetch fill find finish fix float
fold follow forgive gather gaze glow grab greet grow guard guess hang harvest hatch hear help
hike hope hum hunt hurry identify ignore imagine improve include inform invent invite jog join
judge jump kneel knit knock land laugh launch lead learn lend lift listen load lock march measure
melt mend milk mix nod notice obey observe offer order own pack paint pause peel perform
pinch plant play plead point polish pour praise pray preach prefer prepare protect pull punch push
rattle reach read realize receive reflect relax remain remember repair repeat reply rescue rest
return rinse roar roll rub rush scatter scrub search settle sew shake share shine shiver
shout sing sink skip sleep slide smell smile sneeze snore solve sort spell spill spin splash
spread sprint squeeze stack stare steer stir stretch study succeed suggest supply surround
swallow sweep swim swing talk taste teach tease tell thank throw tickle touch trace trade travel
tremble trust tumble twist type unite unlock unpack use vanish visit wait walk wander want warn
wash watch weave whisper win wink wish wonder worry wrap write yawn yell zoom
""".split())

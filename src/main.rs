fn main() {
    println!("gpufrac (in progress)");
}

//! Writing to the terminal from commands (not from the gateway's request path).

/// Print a result to stdout; a closed pipe (`| head`) is not an error worth a panic.
pub fn print_out(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{text}");
}
